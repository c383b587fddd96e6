"""Two vLLM behaviours seen on /metrics: ``iteration_tokens_total`` counts once per engine
step (in the colocated and the P+D layout), and non-streaming clients that time out free
the engine (their requests are aborted in the worker, not run to max_tokens)."""
from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import module_server, wait_for  # noqa: E402

LAYOUTS = {"colocated": (), "1p1d": ("--prefill-workers", "1", "--decode-workers", "1")}
PROMPT = list(range(100, 120))  # 20 prompt tokens, sent as token ids


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(request, tiny_qwen2_vl, tmp_path_factory):
    yield from module_server(tiny_qwen2_vl, tmp_path_factory, "--block-size", "4",
                             "--max-model-len", "1024", "--served-model-name", "tiny",
                             *LAYOUTS[request.param])


def _counts(server) -> tuple[float, float, float]:
    """Generated tokens, iteration_tokens_total's count and sum, over every pool."""
    return (server.metric("triptych:generation_tokens_total"),
            server.metric("triptych:iteration_tokens_total_count"),
            server.metric("triptych:iteration_tokens_total_sum"))


def _settled(server, generated: float) -> tuple[float, float, float]:
    """The counts once the workers' stats (sent every 0.25 s) show ``generated`` tokens."""
    return wait_for(lambda: (c := _counts(server))[0] >= generated and c,
                    f"the stats to show {generated} generated tokens")


def test_iteration_tokens_count_once_per_step(server):
    """vLLM's count for requests run one at a time: one observation per output token, and
    the prompt counted once, in the step of its first token (cache hits included)."""
    client = server.openai_client()
    gen0, _, _ = _counts(server)
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                              extra_body={"ignore_eos": True})  # the histogram exists
    gen0, count0, sum0 = _settled(server, gen0 + 2)
    num_requests, max_tokens = 3, 4
    for _ in range(num_requests):  # one at a time: each step holds one request
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == max_tokens
    gen1, count1, sum1 = _settled(server, gen0 + num_requests * max_tokens)
    assert gen1 == gen0 + num_requests * max_tokens
    assert count1 - count0 == num_requests * max_tokens
    assert sum1 - sum0 == num_requests * (len(PROMPT) + max_tokens)


def test_timed_out_clients_free_the_engine(server):
    """50 non-streaming requests of 900 tokens each whose clients give up after 0.5 s: the
    engine is empty again long before they could have finished."""
    wait_for(lambda: server.metric("triptych:num_requests_running") == 0, "an idle server")
    num_requests, max_tokens = 50, 900
    gen0 = server.metric("triptych:generation_tokens_total")

    def call(_: int) -> str:
        try:
            httpx.post(server.base + "/v1/completions", timeout=0.5, json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens,
                "ignore_eos": True})
        except httpx.TimeoutException:
            return "timeout"
        return "answered"

    with ThreadPoolExecutor(num_requests) as pool:
        outcomes = list(pool.map(call, range(num_requests)))
    assert outcomes.count("timeout") == num_requests
    # (the stats show the requests admitted before they may show them gone)
    wait_for(lambda: server.metric("triptych:generation_tokens_total") > gen0,
             "the requests to run")
    wait_for(lambda: server.metric("triptych:num_requests_running") == 0,
             "the timed-out requests to be aborted", timeout=120)
    made = server.metric("triptych:generation_tokens_total") - gen0
    # NOTE: every request admitted ran at most a fraction of its max_tokens.
    assert made < num_requests * max_tokens / 2, made
    # nothing left queued either, and the server still answers
    assert server.metric("triptych:num_requests_waiting") == 0
    r = server.openai_client().completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_beam_search_runs_colocated_and_is_refused_in_p_d(server, request):
    """(Shares this module's two servers.) Beam search runs where a colocated engine
    decodes; a prefill pool (P+D) answers a 400 naming use_beam_search."""
    import openai

    client = server.openai_client()
    body = {"use_beam_search": True, "ignore_eos": True}
    if "colocated" in request.node.callspec.id:
        r = client.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=3,
                                      extra_body=body)
        assert len(r.choices) == 2 and r.choices[0].text != r.choices[1].text
        return
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=3,
                                  extra_body=body)
    assert "P+D" in str(e.value) and e.value.body["param"] == "use_beam_search"
