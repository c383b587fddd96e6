"""The demo checkpoint (trained, shipped in the package) and tiny random checkpoints built
on first use and cached (tests, benchmarks)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger("triptych.models")

# The `triptych bench throughput` default: ~100M-class layout on random weights.
# The embedding is padded to Qwen2-VL's real vocabulary (151936 rows, tied head): ~106M
# parameters, and the LM head's cost per token is what it is on the real models.
BENCH_FLAGS: dict[str, Any] = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                                   vision_depth=4, vision_embed_dim=256, vision_heads=4,
                                   vocab_size=4096, model_vocab_size=151936)
DEMO_FLAGS: dict[str, Any] = dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                                  vision_depth=2, vision_embed_dim=64, vision_heads=2)


def cache_root() -> Path:
    return Path(os.environ.get("TRIPTYCH_CACHE", Path.home() / ".cache" / "triptych"))


def tiny_checkpoint(arch: str = "qwen2_vl", seed: int = 0, **flags: Any) -> str:
    """Path of a tiny checkpoint with these flags, built (once) with make_tiny if missing."""
    from triptych.models.tiny import make_tiny

    key = hashlib.sha256(json.dumps([arch, seed, flags], sort_keys=True).encode()).hexdigest()[:12]
    out = cache_root() / f"tiny-{arch}-{key}"
    if not (out / "config.json").exists():
        logger.info("building tiny %s checkpoint (random weights) in %s", arch, out)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        make_tiny(arch, str(tmp), seed=seed, **flags)
        os.makedirs(out.parent, exist_ok=True)
        try:
            os.rename(tmp, out)
        except OSError:  # another process won the race
            pass
    return str(out)


def demo_checkpoint() -> str:
    """The built-in demo model: a tiny Qwen2-VL trained by demo/train.py to transcribe
    printed text, shipped in the package (demo/ocr_demo; docs/demo-model.md)."""
    path = Path(__file__).resolve().parents[1] / "demo" / "ocr_demo"
    if not (path / "model.safetensors").exists():
        raise FileNotFoundError(f"the demo checkpoint is missing from {path}: reinstall "
                                "triptych, or pass --model")
    return str(path)
