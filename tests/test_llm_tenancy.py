"""The offline LLM (issue 15): ``cache_salt`` per request, as vLLM's prompt dict carries it
(and ``chat(..., cache_salt=)``), scopes the prefix cache and media uuids as on the server;
an LLM with worker processes that the script never closes exits cleanly, leaving no
traceback, process, run dir or shared-memory segment behind."""
from __future__ import annotations

import base64
import glob
import io
import os
import subprocess
import sys

import pytest
from PIL import Image
from triptych import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import alive

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>Describe."


def _image(seed: int) -> Image.Image:
    return Image.frombytes("RGB", (56, 56), bytes((seed * 7 + i) % 256 for i in range(56 * 56 * 3)))


def _data_url(im: Image.Image) -> str:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl):
    return LLM(tiny_qwen2_vl, block_size=4, max_model_len=512)


def test_cache_salt_scopes_the_offline_prefix_cache(llm):
    text = "The mill by the river turned all day while the hills stayed quiet. " * 3
    hits = lambda: llm.engine.core.kv.num_prefix_hits

    def run(salt: str | None) -> tuple[list[int], int]:
        before = hits()
        prompt = {"prompt": text} if salt is None else {"prompt": text, "cache_salt": salt}
        out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        return out.outputs[0].token_ids, hits() - before

    first, _ = run("a")
    again, hit_a = run("a")
    other, hit_b = run("b")
    plain, hit_none = run(None)
    plain_again, hit_plain = run(None)
    assert hit_a > 0 and hit_plain > 0  # each scope hits its own cache
    assert hit_b == 0 and hit_none == 0  # and never another's
    assert first == again == other == plain == plain_again  # the answer is the same
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt": text, "cache_salt": ""}, GREEDY, use_tqdm=False)


def test_cache_salt_scopes_offline_uuids(llm):
    im = _image(3)
    named = {"prompt": IMAGE, "multi_modal_data": {"image": [im]},
             "multi_modal_uuids": {"image": ["photo"]}}
    by_name = {"prompt": IMAGE, "multi_modal_data": {"image": [None]},
               "multi_modal_uuids": {"image": ["photo"]}}
    want = llm.generate({**named, "cache_salt": "a"}, GREEDY, use_tqdm=False)[0]
    got = llm.generate({**by_name, "cache_salt": "a"}, GREEDY, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for other in ({**by_name, "cache_salt": "b"}, by_name):  # another scope: not held
        with pytest.raises(ValueError, match="unknown image uuid"):
            llm.generate(other, GREEDY, use_tqdm=False)
    # chat: the same, one salt per conversation
    part = {"type": "image_url", "image_url": {"url": _data_url(_image(4))}, "uuid": "page"}
    ref = {"type": "image_url", "image_url": None, "uuid": "page"}
    msgs = lambda p: [{"role": "user", "content": [p, {"type": "text", "text": "Read."}]}]
    a = llm.chat(msgs(part), GREEDY, use_tqdm=False, cache_salt="t1")[0]
    b = llm.chat([msgs(ref)], GREEDY, use_tqdm=False, cache_salt=["t1"])[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    with pytest.raises(ValueError, match="unknown image uuid"):
        llm.chat(msgs(ref), GREEDY, use_tqdm=False, cache_salt="t2")


SCRIPT = """
import os, sys
from triptych import LLM, SamplingParams
llm = LLM(sys.argv[1], block_size=4, max_model_len=512, decode_workers=1)
out = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=3),
                   use_tqdm=False)
pids = [w.pid for w in llm.pools.router.supervisor.workers]
print("PIDS", os.getpid(), *pids, "TOKENS", *out[0].outputs[0].token_ids, flush=True)
# no llm.close(): vLLM scripts never call it
"""


def test_an_unclosed_offline_llm_with_pools_exits_cleanly(tiny_qwen2_vl, tmp_path):
    script = tmp_path / "unclosed.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script), tiny_qwen2_vl], capture_output=True,
                       text=True, timeout=600, check=False)  # hang guard
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "cannot schedule" not in out, out[-3000:]
    assert "Task was destroyed" not in out, out[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("PIDS"))
    pids = line.split("TOKENS")[0].split()[1:]
    assert len(line.split("TOKENS")[1].split()) == 3
    assert not any(alive(int(p)) for p in pids[1:])  # its workers are gone
    left = [p for p in glob.glob("/tmp/triptych-*") + glob.glob("/dev/shm/triptych-*")
            if os.path.basename(p).startswith(f"triptych-{pids[0]}-")]
    assert left == []
