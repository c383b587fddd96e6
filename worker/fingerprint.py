"""model_fingerprint: which checkpoint a worker serves, cheap enough to compute at start.

    sha256( config.json bytes
            + for each *.safetensors file, by name: name, size, its JSON header,
              and SAMPLES slices of SAMPLE_BYTES spread evenly over its tensor data )

The header names every tensor with its dtype, shape and offsets; the sampled bytes tell
apart two checkpoints of the same shape (another fine-tune, another seed: their weights
differ everywhere, so any slice shows it) while reading ~1 MiB per file, not the weights.
A checkpoint that differs only outside every sampled slice is beyond it (liveness notes).
"""
from __future__ import annotations

import hashlib
import os
import struct

MAX_HEADER_BYTES = 100 << 20  # safetensors caps its header at 100 MB
SAMPLES, SAMPLE_BYTES = 16, 64 << 10


def model_fingerprint(model_dir: str) -> str:
    """Hex digest of ``model_dir``'s config and weights ("" if it holds neither)."""
    h = hashlib.sha256()
    found = False
    names = sorted(os.listdir(model_dir)) if os.path.isdir(model_dir) else []
    for name in names:
        path = os.path.join(model_dir, name)
        if name == "config.json":
            with open(path, "rb") as f:
                h.update(b"config\0" + f.read())
            found = True
        elif name.endswith(".safetensors"):
            size = os.path.getsize(path)
            h.update(f"{name}\0{size}\0".encode())
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                h.update(f.read(min(n, MAX_HEADER_BYTES)))
                start = 8 + n
                span = max(0, size - start - SAMPLE_BYTES)
                for i in range(SAMPLES):
                    f.seek(start + span * i // max(SAMPLES - 1, 1))
                    h.update(f.read(SAMPLE_BYTES))
            found = True
    return h.hexdigest() if found else ""
