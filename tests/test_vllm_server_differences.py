"""The last differences from vLLM's OpenAI server (issue 34, point 5), each through the real
`openai` client against `triptych serve`:

- a streamed completion with ``logprobs`` carries a logprobs object in every chunk (echo,
  return_token_ids, several prompts and n > 1 included), as vLLM's does;
- ``iteration_tokens_total`` counts tokens scheduled per engine step (vLLM's test: 10
  completions of a 25-token prompt, 10 tokens each, one at a time: sum 350, count 100);
- clients that give up abort their requests in the engine at once, queued ones included,
  so a new request is not stuck behind abandoned work (vLLM's test_request_cancellation).

The server runs one request at a time (``--max-num-seqs 1``): every other one waits in the
engine's queue, which makes "aborted before it ever ran" an event the metrics can show.
"""
from __future__ import annotations

import asyncio
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import module_server, wait_for  # noqa: E402

openai = pytest.importorskip("openai")
PROMPT = list(range(100, 125))  # 25 prompt tokens, sent as token ids
LONG = 8000  # tokens the blocker may write: far more than the test needs it to run


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, tmp_path_factory):
    yield from module_server(tiny_qwen2_vl, tmp_path_factory, "--max-num-seqs", "1",
                             "--max-model-len", "8192", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


# -- (a) streamed completions with logprobs -----------------------------------------------------
@pytest.mark.parametrize("kw", [{}, {"echo": True}, {"extra_body": {"return_token_ids": True}},
                                {"n": 2, "echo": True}, {"prompt": [PROMPT[:5], PROMPT[5:12]]}],
                         ids=["plain", "echo", "return_token_ids", "n2-echo", "two-prompts"])
def test_every_streamed_completion_chunk_carries_logprobs(client, kw):
    kw = {"prompt": PROMPT[:8], "max_tokens": 4, "logprobs": 2, "temperature": 0,
          "extra_body": {"ignore_eos": True, **kw.pop("extra_body", {})}, **kw}
    whole = client.completions.create(model="tiny", **kw)
    tokens: dict[int, list[str]] = {}
    texts: dict[int, str] = {}
    for chunk in client.completions.create(model="tiny", stream=True, **kw):
        for ch in chunk.choices:
            assert ch.logprobs is not None, chunk  # vLLM: never null in such a stream
            assert len(ch.logprobs.tokens) == len(ch.logprobs.token_logprobs)
            tokens.setdefault(ch.index, []).extend(ch.logprobs.tokens)
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    # the stream's pieces add up to the whole answer, the echoed prompt's logprobs first
    assert sorted(tokens) == [c.index for c in whole.choices]
    for c in whole.choices:
        assert tokens[c.index] == c.logprobs.tokens and texts[c.index] == c.text


# -- (b) iteration_tokens_total -----------------------------------------------------------------
def test_iteration_tokens_as_vllm_counts_them(server, client):
    """Read as vLLM's test reads them: right after the last answer, no waiting. A worker
    reports a step's stats before the outputs that end a request, so what an answer
    shows is counted by then (and a reading taken after earlier answers is complete)."""
    def counts() -> tuple[float, float, float]:
        return (server.metric("triptych:generation_tokens_total"),
                server.metric("triptych:iteration_tokens_total_count"),
                server.metric("triptych:iteration_tokens_total_sum"))

    client.completions.create(model="tiny", prompt=PROMPT[:3], max_tokens=2)  # just ended
    gen0, count0, sum0 = counts()
    for _ in range(10):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10,
                                      extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens == 25 and r.usage.completion_tokens == 10
    gen1, count1, sum1 = counts()
    assert (gen1 - gen0, count1 - count0, sum1 - sum0) == (100, 100, 350)


# -- (c) abandoned requests ---------------------------------------------------------------------
def test_clients_that_give_up_free_the_engine_at_once(server, client):
    """A long stream holds the engine's one slot; 200 clients that give up after 0.5 s queue
    behind it. Each is aborted in the engine's queue while the stream still runs (none
    ever runs), and a new request is answered."""
    wait_for(lambda: server.metric("triptych:num_requests_running") == 0, "an idle server")
    names = ("triptych:request_queue_time_seconds_count", "triptych:request_params_n_count",
             "triptych:request_success_total")
    scheduled0, submitted0, _ = (server.metric(n) for n in names)
    aborted0 = server.metric("triptych:request_success_total", finished_reason="abort")
    blocker = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=LONG,
                                        stream=True, extra_body={"ignore_eos": True})
    chunks = iter(blocker)
    next(chunks)  # it runs: the slot is taken
    try:
        gave_up = asyncio.run(_give_up(server, 200))
        assert gave_up == ["APITimeoutError"] * 200
        # NOTE: the blocker keeps the slot all along; without aborts in the queue the
        # waiting requests would stay until it ends.
        seen = wait_for(lambda: (m := server.metrics())["triptych:num_requests_waiting"] == 0
                        and m, "the abandoned requests to leave the engine's queue",
                        timeout=120)
        assert seen["triptych:num_requests_running"] == 1, "the blocker ended first"
    finally:
        blocker.close()  # the last client leaves too
    wait_for(lambda: server.metric("triptych:num_requests_running") == 0,
             "the blocker to be aborted", timeout=120)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    scheduled, submitted, _ = (server.metric(n) for n in names)
    aborted = server.metric("triptych:request_success_total", finished_reason="abort")
    # scheduled: the blocker and the last request only; every request the engine took but
    # the last one ended as an abort (those whose client left before P0 read them never
    # reached it)
    assert scheduled - scheduled0 == 2
    assert aborted - aborted0 == submitted - submitted0 - 1 >= 1


async def _give_up(server, n: int) -> list[str]:
    """``n`` non-streaming requests for long answers whose clients wait 0.5 s (no retries)."""
    impatient = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="unused",
                                   timeout=0.5, max_retries=0)
    calls = [impatient.completions.create(model="tiny", prompt=PROMPT, max_tokens=LONG,
                                          extra_body={"ignore_eos": True}) for _ in range(n)]
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    await impatient.close()
    return [type(o).__name__ for o in outcomes]
