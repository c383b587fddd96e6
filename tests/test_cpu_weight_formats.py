"""A 16-bit and an int8 model served end to end (kernels/cpu/linear.py): a real `triptych
serve --dtype bfloat16` / `--quantization int8` and the real openai client. The served
tokens and log-probs are those of the offline engine with the same weight format, and
measurably not fp32's, so a knob lost on the way to the worker fails the test.

Each format is served twice on a CPU with AVX-512: as it is, and under
``TRIPTYCH_CPU_ISA=avx2`` (engine/device/cpu_features.py), where oneDNN's bf16 GEMM refuses as on
an AVX2-only CPU and the engine's own kernels serve the weights (the offline engine it is
compared with runs under the same switch, in its own process)."""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys

import pytest
from triptych.engine.device.platform import cpu_kernels
from triptych.kernels.cpu import linear as cpu_linear

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import ServerProc, data_url, image_part, img, png, text_part, user

pytestmark = pytest.mark.skipif(not (cpu_linear.available("bfloat16")
                                     and cpu_linear.available("int8")),
                                reason="this torch build lacks oneDNN bf16 or fbgemm int8")

PROMPT = "Once upon a time"
FLAGS = {"bfloat16": ("--dtype", "bfloat16"), "int8": ("--quantization", "int8")}
KNOBS = {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}}


# the switch is worth a second server only where this CPU is more than AVX2-only
LEVELS = ["native"] + (["avx2"] if cpu_kernels().variant.startswith("avx512") else [])


@functools.cache  # (float32's answer serves both formats' checks)
def offline(model: str, fmt: str, level: str = "native") -> tuple[list[int], list[float]]:
    if level != "native":  # the switch acts before torch's first op: a process of its own
        code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
                "from test_cpu_weight_formats import offline; "
                f"print(json.dumps(offline({model!r}, {fmt!r})))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "TRIPTYCH_CPU_ISA": level}, timeout=600,
                             check=False)
        assert out.returncode == 0, out.stderr[-3000:]
        ids, lps = json.loads(out.stdout.strip().splitlines()[-1])
        return ids, lps
    from triptych import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=4, num_kv_blocks=64, cpu_threads=1, **KNOBS[fmt])
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    llm.close()
    return list(out.token_ids), [d[t].logprob for d, t in zip(out.logprobs, out.token_ids)]


@pytest.fixture(scope="module", params=[(f, lv) for lv in LEVELS for f in sorted(FLAGS)],
                ids=lambda p: f"{p[0]}-{p[1]}")
def served(request, tiny_qwen2_vl, tmp_path_factory):
    fmt, level = request.param
    server = ServerProc(tiny_qwen2_vl, tmp_path_factory.mktemp("log") / "serve.log",
                        *FLAGS[fmt], "--num-kv-blocks", "64", "--cpu-threads", "1",
                        "--served-model-name", "tiny",
                        env={} if level == "native" else {"TRIPTYCH_CPU_ISA": level})
    try:
        yield fmt, level, server
    finally:
        server.stop(signal.SIGKILL)
        server.cleanup_descendants()


def test_a_narrow_weight_format_served_through_the_openai_api(served, tiny_qwen2_vl):
    fmt, level, server = served
    client = server.openai_client()
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                  logprobs=0, extra_body={"return_token_ids": True})
    c = r.choices[0]
    ids, lps = c.model_extra["token_ids"], c.logprobs.token_logprobs
    want_ids, want_lps = offline(tiny_qwen2_vl, fmt, level)
    _, fp32_lps = offline(tiny_qwen2_vl, "float32", level)
    assert ids == want_ids
    same = max(abs(a - b) for a, b in zip(lps, want_lps))
    apart = max(abs(a - b) for a, b in zip(want_lps, fp32_lps))
    # bf16 / int8 weights move the log-probs by ~1e-3..1e-2 on this model; the same format
    # in another process differs by summation order only
    assert apart > 5e-4 and same < apart / 5, (same, apart)
    chat = client.chat.completions.create(
        model="tiny", max_tokens=4, temperature=0,
        messages=user(image_part(data_url(png(img(3)))), text_part("What is this?")))
    assert chat.choices[0].finish_reason == "length"  # the vision tower ran packed too
