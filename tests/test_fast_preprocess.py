"""The fast preprocessing path (``--mm-preprocessor fast``, models/image_ops.py) against HF's
own image processors on the raw images, bit for bit: Pillow's resize (the C++ passes, every
instruction-set copy of them this CPU runs, the copy a fresh process's platform chooses, and
Pillow itself where they cannot be built), each architecture's layout (Qwen2-VL / Qwen2.5-VL
/ Qwen3-VL patches, InternVL tiles), over sizes, aspect ratios and pixel modes, under the
tiny checkpoints' processor files and the hub checkpoints' settings. Also: the knob, the
fall-back for settings the fast path cannot follow, and the key of a PIL image hashed
without a copy.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import torch
from PIL import Image
from triptych.api.media.pixels import to_rgb8
from triptych.bench.prep import SETUPS
from triptych.engine.device import cpu_features
from triptych.kernels.cpu import build as cpu_build
from triptych.kernels.cpu import image_resample, isa
from triptych.mmcache.hashing import hash_image, hash_pixels, media_key
from triptych.models import image_ops
from triptych.models.contract import contract_for_type

sys.path.insert(0, os.path.dirname(__file__))
from cpu_variants import ids, runnable  # noqa: E402

rng = np.random.default_rng(0)


def noise(w: int, h: int) -> np.ndarray:
    """The resize's hardest case: every sample independent (clipping, rounding everywhere)."""
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


def photo(w: int, h: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / max(w, 1), y * 255 / max(h, 1), (x * 3 + y) % 256], -1)
    return np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)


# -- the resize -------------------------------------------------------------------------------
RESIZES = [  # (w, h) -> (W, H): down, up, mixed, both pass orders, extreme aspects
    (1920, 1080, 1316, 728), (1080, 1920, 728, 1316), (640, 480, 644, 476),
    (480, 640, 476, 644), (640, 480, 700, 470), (640, 480, 630, 200), (100, 100, 200, 50),
    (1, 1, 56, 56), (3, 200, 28, 476), (200, 3, 476, 28), (37, 1001, 28, 1008),
    (999, 13, 504, 28), (300, 299, 308, 308), (17, 17, 3, 5), (4000, 20, 1000, 7),
]


@pytest.mark.parametrize("w, h, W, H", RESIZES)
@pytest.mark.parametrize("resample", [image_ops.BICUBIC, image_ops.BILINEAR])
def test_resize_is_pillows_bit_for_bit(w, h, W, H, resample) -> None:
    a = noise(w, h)
    ours = image_ops.resize_u8(image_ops.as_tensor(a), H, W, resample)
    ref = np.asarray(Image.fromarray(a).resize((W, H), resample))
    assert ours.shape == (H, W, 3) and np.array_equal(ours.numpy(), ref)


COPIES = runnable(image_resample._built()) if image_resample.available() else []


@pytest.mark.parametrize("variant", COPIES, ids=ids(COPIES))
@pytest.mark.parametrize("w, h, W, H", RESIZES)
def test_every_copy_of_the_kernel_is_pillows(variant, w, h, W, H) -> None:
    a = noise(w, h)
    for resample in (image_ops.BICUBIC, image_ops.BILINEAR):
        ours = image_resample.resize(image_ops.as_tensor(a), H, W, resample, variant=variant)
        ref = np.asarray(Image.fromarray(a).resize((W, H), resample))
        assert np.array_equal(ours.numpy(), ref), (isa.NAMES[variant], resample)


def test_the_kernel_is_used_here_and_pillow_stands_in_without_it(monkeypatch) -> None:
    # with a compiler here the C++ passes are what ran above, not Pillow standing in: a
    # kernel that stops building would otherwise show only as a slower resize
    assert cpu_build.compiler() is None or image_resample.available()
    assert (image_ops.BICUBIC, image_ops.BILINEAR) == (image_resample.BICUBIC,
                                                       image_resample.BILINEAR)
    monkeypatch.setattr(image_resample, "available", lambda: False)
    a = noise(333, 250)
    ours = image_ops.resize_u8(image_ops.as_tensor(a), 196, 280)
    assert np.array_equal(ours.numpy(), np.asarray(Image.fromarray(a).resize((280, 196), 3)))


def test_the_kernel_refuses_taps_outside_its_input_and_copies_it_lacks() -> None:
    if not image_resample.available():
        pytest.skip("no C++ compiler here: Pillow resizes")
    src = torch.zeros(10, 30, dtype=torch.uint8)
    bounds = torch.tensor([[8, 4]], dtype=torch.int32)  # rows 8..11 of 10
    w = torch.ones(1, 4, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="bounds outside the input"):
        torch.ops.triptych_image.resample_rows(src, bounds, w, 0)
    with pytest.raises(RuntimeError, match="bounds outside the input"):
        torch.ops.triptych_image.resample_cols(src.view(10, 10, 3), bounds, w, 0)
    with pytest.raises(RuntimeError, match="holds no kernel variant 7"):
        torch.ops.triptych_image.resample_rows(src, bounds * 0, w, 7)


# A process that prepares images (P0, a preparation process) and runs no engine: its first
# resize asks the platform which copy this CPU runs (models/image_ops.py), as an engine would.
PREP = """
import json, numpy as np, triptych
from PIL import Image
from triptych.kernels.cpu import image_resample, isa
from triptych.models import image_ops
a = np.random.default_rng(1).integers(0, 256, (90, 160, 3), dtype=np.uint8)
out = image_ops.resize_u8(image_ops.as_tensor(a), 50, 70)
print(json.dumps({"available": image_resample.available(), "chosen": isa.chosen().variant,
                  "runs": image_resample.variant_id(), "built": image_resample._built(),
                  "equal": np.array_equal(out.numpy(),
                                          np.asarray(Image.fromarray(a).resize((70, 50), 3)))}))
"""
CPU = cpu_features.detect()


@pytest.mark.parametrize("level", ["native", "avx2"])
def test_a_preparation_process_runs_the_copy_its_platform_chooses(level) -> None:
    flags = CPU.flags | CPU.hidden  # the CPU itself, whatever this process's switch
    expected = isa.best_variant(cpu_features.features(CPU.model, flags, level).flags)
    if level == "avx2" and expected != "avx2":
        pytest.skip("this CPU has no AVX2/FMA/F16C: nothing to force")
    if cpu_build.compiler() is None:
        pytest.skip("no C++ compiler here: Pillow resizes")
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
                        "FBGEMM_ENABLE_INSTRUCTIONS", "MKL_ENABLE_INSTRUCTIONS")}
    out = subprocess.run([sys.executable, "-c", PREP], env={**env, "TRIPTYCH_CPU_ISA": level},
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["available"] and got["equal"] and got["chosen"] == expected
    top = isa.NAMES.index(expected)
    assert got["runs"] == max(v for v in got["built"] if v <= top)


# -- each architecture against HF's processor ---------------------------------------------------
def _tiny_processor(tmp_path_factory, model_type: str):
    from transformers import AutoConfig, AutoImageProcessor
    from triptych.models.tiny import make_tiny

    d = make_tiny(model_type, str(tmp_path_factory.mktemp("tiny") / model_type), seed=0)
    return (AutoImageProcessor.from_pretrained(d, local_files_only=True, backend="pil"),
            AutoConfig.from_pretrained(d, local_files_only=True))


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl"])
def tiny(request, tmp_path_factory):
    """(model_type, HF image processor, HF config) of a tiny checkpoint's own files."""
    ip, cfg = _tiny_processor(tmp_path_factory, request.param)
    return request.param, ip, cfg


def hf_reference(model_type: str, ip, cfg, raw: Image.Image) -> tuple[torch.Tensor, tuple]:
    """HF's processor on the raw image, in the layout the contract hands on."""
    if model_type == "internvl":
        from triptych.models.internvl import patchify

        tiles = ip(images=[raw], crop_to_patches=True, return_tensors="pt")["pixel_values"]
        g = tiles.shape[-1] // 14
        return patchify(tiles, 14), (tiles.shape[0], g, g)
    out = ip(images=[raw], return_tensors="pt")
    return out["pixel_values"], tuple(int(x) for x in out["image_grid_thw"][0])


def fast(model_type: str, ip, cfg, raw: Image.Image) -> tuple[torch.Tensor, tuple]:
    contract = contract_for_type(model_type)
    return contract.preprocess_image(ip, image_ops.rgb_array(to_rgb8(raw)), cfg, "fast")


SIZES = [(1, 1), (3, 200), (200, 3), (1, 199), (56, 56), (50, 70), (70, 50), (84, 56),
         (224, 224), (333, 97), (97, 333), (1000, 7), (641, 479), (1280, 720)]


@pytest.mark.parametrize("w, h", SIZES)
def test_pixels_and_grid_equal_hfs_over_sizes(tiny, w, h) -> None:
    model_type, ip, cfg = tiny
    for a in (noise(w, h), photo(w, h)):
        raw = Image.fromarray(a)
        pv, grid = fast(model_type, ip, cfg, raw)
        ref, ref_grid = hf_reference(model_type, ip, cfg, raw)
        assert grid == ref_grid and pv.dtype == torch.float32
        assert torch.equal(pv, ref)


def modes(a: np.ndarray) -> dict[str, tuple[Image.Image, Image.Image]]:
    """(image in a mode, what HF's processor reads as the same content): HF converts these
    modes as we do, save 16-bit grey, which HF clips: its reference is the 8-bit twin."""
    g = a[..., 0]
    rgba = np.concatenate([a, g[..., None]], -1)
    p = Image.fromarray(a).quantize(16)
    p.info["transparency"] = 3
    cmyk = Image.frombytes("CMYK", (a.shape[1], a.shape[0]),
                           np.concatenate([a, 255 - g[..., None]], -1).tobytes())
    sixteen = Image.fromarray(g.astype(np.uint16) * 257)
    out = {"L": Image.fromarray(g), "LA": Image.fromarray(rgba[..., [0, 3]], mode="LA"),
           "RGBA": Image.fromarray(rgba), "P+transparency": p, "CMYK": cmyk, "1":
           Image.fromarray(g).convert("1")}
    pairs = {k: (v, v) for k, v in out.items()}
    pairs["I;16"] = (sixteen, Image.fromarray(g))
    return pairs


@pytest.mark.parametrize("w, h", [(61, 45), (45, 61), (300, 200)])
def test_pixels_equal_hfs_over_modes(tiny, w, h) -> None:
    model_type, ip, cfg = tiny
    for name, (img, hf_reads) in modes(photo(w, h)).items():
        pv, grid = fast(model_type, ip, cfg, img)
        ref, ref_grid = hf_reference(model_type, ip, cfg, hf_reads)
        assert grid == ref_grid and torch.equal(pv, ref), name


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("w, h", [(1920, 1080), (720, 1280), (3, 500), (448, 448)])
def test_hub_settings_equal_hfs(setup, w, h) -> None:
    """The hub checkpoints' processor settings (bench/prep.py): Qwen2-VL's 12.8 M pixels
    and the capped 1 M, Qwen3-VL's 32-pixel cells, InternVL's 448-pixel tiles."""
    s = SETUPS[setup]
    ip = s.make()
    raw = Image.fromarray(photo(w, h))
    pv, grid = contract_for_type(s.model_type).preprocess_image(ip, raw, s.hf, "fast")
    ref, ref_grid = hf_reference(s.model_type, ip, s.hf, raw)
    assert grid == ref_grid and torch.equal(pv, ref)


@pytest.mark.parametrize("w, h", [(1, 1), (641, 479), (97, 333)])
def test_values_go_where_the_caller_asks(tiny, w, h) -> None:
    """``pixel_shape`` sizes the output before any work; ``out`` (e.g. a shared-memory
    slot) receives the values in place, on either path; a wrong one is refused."""
    model_type, ip, cfg = tiny
    contract, raw = contract_for_type(model_type), Image.fromarray(photo(w, h))
    ref, ref_grid = hf_reference(model_type, ip, cfg, raw)
    shape = contract.pixel_shape(ip, cfg, h, w)
    assert shape == tuple(ref.shape)
    for path in ("fast", "hf"):
        out = torch.full(shape, float("nan"))
        pv, grid = contract.preprocess_image(ip, raw, cfg, path, out=out)
        assert pv.data_ptr() == out.data_ptr() and grid == ref_grid
        assert torch.equal(out, ref), path
    with pytest.raises(ValueError, match="out must be a contiguous float32 tensor"):
        contract.preprocess_image(ip, raw, cfg, "fast", out=torch.empty(shape[0] + 1, shape[1]))


# -- settings, the knob, the fall-back ------------------------------------------------------------
def test_other_rescale_and_normalise_settings_are_followed() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    raw = Image.fromarray(photo(90, 60))
    for kw in ({"do_normalize": False}, {"do_rescale": False},
               {"image_mean": [0.1, 0.2, 0.3], "image_std": [0.9, 0.8, 0.7]},
               {"resample": image_ops.BILINEAR}):
        ip = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=200704, **kw)
        pv, grid = contract_for_type("qwen2_vl").preprocess_image(ip, raw, None, "fast")
        ref = ip(images=[raw], return_tensors="pt")
        assert torch.equal(pv, ref["pixel_values"]), kw


def test_settings_it_cannot_follow_go_to_hfs_processor(caplog) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    ip = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=200704, resample=1)  # Lanczos
    raw = Image.fromarray(photo(90, 60))
    with caplog.at_level("WARNING", logger="triptych.models"):
        pv, _ = contract_for_type("qwen2_vl").preprocess_image(ip, raw, None, "fast")
    assert torch.equal(pv, ip(images=[raw], return_tensors="pt")["pixel_values"])
    assert "resample 1" in caplog.text and "HF's processor runs instead" in caplog.text


def test_the_knob_is_checked_and_documented() -> None:
    from triptych.config import EngineConfig

    assert EngineConfig(model="m").mm_preprocessor == "fast"
    with pytest.raises(ValueError, match="mm_preprocessor must be 'fast' or 'hf'"):
        EngineConfig(model="m", mm_preprocessor="turbo")
    with pytest.raises(ValueError, match="mm_preprocessor must be one of fast, hf"):
        contract_for_type("qwen2_vl").preprocess_image(None, photo(8, 8), None, "turbo")
    out = subprocess.run([sys.executable, "-m", "triptych", "serve", "--help"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    flat = " ".join(out.split())
    assert "--mm-preprocessor" in flat and "(default: fast)" in flat


# -- the key of a PIL image --------------------------------------------------------------------
def test_pixels_are_hashed_in_place() -> None:
    img = Image.fromarray(photo(1920, 1080))
    arr = image_ops.rgb_array(img)  # the one copy out of Pillow, which the fast path reads
    kw = {"a": 1}
    tracemalloc.start()
    try:
        key = hash_pixels(arr, kw)
        in_place = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        hash_image(img, kw)
        with_copy = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert in_place < 1 << 20 <= arr.nbytes <= with_copy  # no second copy of 6 MB
    assert media_key("image", kw, payload=arr) == key
    tall = np.ascontiguousarray(arr.reshape(1920, 1080, 3))  # same bytes, other shape
    assert hash_pixels(tall, kw) != key and hash_pixels(arr, {"a": 2}) != key


def test_an_image_sent_twice_keys_alike_whatever_path_encoded(tmp_path) -> None:
    """The server keys encoded bytes (no decode); a PIL image keys its RGB pixels: a PNG
    and the same pixels given in Python share pixels, not keys, by design."""
    a = photo(40, 30)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    by_bytes = media_key("image", {}, payload=buf.getvalue())
    assert by_bytes == media_key("image", {}, payload=buf.getvalue())
    assert by_bytes != media_key("image", {}, payload=a)
