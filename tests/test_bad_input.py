"""Bad input gets a clear error naming the problem, and the engine keeps serving."""
from __future__ import annotations

import base64
import io
import json
import shutil

import numpy as np
import pytest
from PIL import Image

from triptych import LLM, SamplingParams
from triptych.engine.request import MMItem

SP = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def png_data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def img(seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, 56, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    img(1).save(media / "ok.png")
    return LLM(tiny_qwen2_vl, max_model_len=256, limit_mm_per_prompt={"image": 2},
               allowed_local_media_path=str(media))


def works(llm: LLM) -> None:
    (out,) = llm.generate("Still serving?", SP, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
        llm.generate("word " * 400, SP, use_tqdm=False)
    works(llm)


def test_too_many_images(llm):
    parts = [{"type": "image", "image": img(i)} for i in range(3)]
    with pytest.raises(ValueError, match="image"):
        llm.chat(user(*parts, {"type": "text", "text": "hi"}), SP, use_tqdm=False)
    works(llm)


def test_unreadable_image(llm):
    bad = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot really").decode()
    with pytest.raises(ValueError):
        llm.chat(user({"type": "image_url", "image_url": {"url": bad}}), SP, use_tqdm=False)
    works(llm)


def test_local_path_outside_allowed_dir(llm, tmp_path):
    outside = tmp_path / "secret.png"
    img(2).save(outside)
    with pytest.raises(ValueError):
        llm.chat(user({"type": "image_url", "image_url": {"url": f"file://{outside}"}}),
                 SP, use_tqdm=False)
    allowed = llm.config.allowed_local_media_path
    escape = f"{allowed}/../{tmp_path.name}/secret.png"
    with pytest.raises(ValueError):
        llm.chat(user({"type": "image_url", "image_url": {"url": escape}}), SP, use_tqdm=False)
    (out,) = llm.chat(user({"type": "image_url", "image_url": {"url": f"{allowed}/ok.png"}},
                           {"type": "text", "text": "ok?"}), SP, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_bad_request_among_running_ones_leaves_them_untouched(llm):
    eng = llm.engine
    good = llm.processor.process_chat(user({"type": "image", "image": img(3)},
                                           {"type": "text", "text": "describe"}))
    eng.add_request("good-1", good.prompt_token_ids, SP, good.mm_items)
    eng.step()  # good-1 is running
    # Forged placeholders (a worker never trusts them): span past the prompt's end.
    it = good.mm_items[0]
    forged = MMItem("image", "x" * 64, offset=len(good.prompt_token_ids) - 2, length=it.length,
                    grid_thw=it.grid_thw, pixel_values=it.pixel_values)
    with pytest.raises(ValueError, match="placeholder"):
        eng.add_request("bad", good.prompt_token_ids, SP, [forged])
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("good-1", good.prompt_token_ids, SP, good.mm_items)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert list(done) == ["good-1"] and len(done["good-1"].outputs[0].token_ids) == 3
    eng.kv.check_integrity()


def test_unknown_architecture(tiny_qwen2_vl, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen2_vl, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MadeUpForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="MadeUpForCausalLM"):
        LLM(str(d))


def test_missing_tensor(tiny_qwen2_vl, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen2_vl, d)
    tensors = load_file(str(d / "model.safetensors"))
    victim = sorted(k for k in tensors if "layers.1.mlp" in k)[0]
    del tensors[victim]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="mlp"):
        LLM(str(d))


def test_prompt_that_needs_more_kv_blocks_than_the_worker_holds(tiny_qwen2_vl):
    # 4 blocks of 16 tokens hold 64; a 100-token prompt would wait for room forever.
    small = LLM(tiny_qwen2_vl, max_model_len=256, num_kv_blocks=4, block_size=16)
    try:
        with pytest.raises(ValueError, match=r"needs 7 KV blocks .* holds 4: raise --kv-cache-memory"):
            small.generate([list(range(10, 110))], SP, use_tqdm=False)
        (out,) = small.generate([list(range(10, 40))], SP, use_tqdm=False)  # still serving
        assert len(out.outputs[0].token_ids) == 3
    finally:
        small.close()
