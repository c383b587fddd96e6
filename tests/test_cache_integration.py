"""The three caches through the real server (issue 9): a multi-turn image conversation
reuses the processed pixels (processor cache), the embeddings (encoder cache) and the KV
(prefix cache), outputs unchanged; uuids name images the server holds; P0 and a worker
that disagree about the processor cache recover; the shm ring leaves nothing behind."""
from __future__ import annotations

import glob
import os
import re
import signal
import sys
import time

import httpx
import pytest
from triptych import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import (
    ServerProc,
    data_url,
    image_part,
    img,
    module_server,
    png,
    text_part,
    user,
    wait_for,
)

MAX_TOKENS = 6
IMAGE = data_url(png(img(77, 112, 84)))
OTHER = data_url(png(img(78, 84, 112)))


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, tmp_path_factory):
    yield from module_server(tiny_qwen2_vl, tmp_path_factory,
                             "--block-size", "4", "--max-model-len", "1024",
                             "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(timeout=60)


@pytest.fixture(scope="module")
def uncached(tiny_qwen2_vl):
    """The reference: every cache off."""
    return LLM(tiny_qwen2_vl, block_size=4, max_model_len=1024, mm_processor_cache_gb=0,
               encoder_cache_size=0, enable_prefix_caching=False)


def want(llm: LLM, msgs: list[dict]) -> str:
    return llm.chat(msgs, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                    use_tqdm=False)[0].outputs[0].text


def ask(client, msgs: list[dict]):
    return client.chat.completions.create(model="tiny", messages=msgs, temperature=0,
                                          max_tokens=MAX_TOKENS)


def counters(s: ServerProc) -> dict[str, float]:
    return {k: s.metric(f"triptych:{k}_total") for k in (
        "mm_processor_cache_queries", "mm_processor_cache_hits", "encoder_cache_queries",
        "encoder_cache_hits", "prefix_cache_queries", "prefix_cache_hits")}


def counters_above(s: ServerProc, before: dict[str, float], *names: str) -> dict[str, float]:
    """The counters once each of ``names`` has grown past ``before``: the workers report
    every 0.25 s, so the test waits for the report (a hang guard, not a sleep)."""
    def grown() -> dict[str, float] | None:
        now = counters(s)
        return now if all(now[n] > before[n] for n in names) else None
    return wait_for(grown, f"{', '.join(names)} to grow")


def test_three_turns_reuse_all_three_caches(server, client, uncached):
    turns = ["What is in this picture?", "And what colour is it?", "Anything else?"]
    msgs: list[dict] = []
    before = counters(server)
    for i, q in enumerate(turns):
        # The client sends the whole conversation each turn: the image rides along in the
        # first message every time.
        msgs.append({"role": "user", "content": [image_part(IMAGE), text_part(q)] if i == 0
                     else q})
        r = ask(client, msgs)
        answer = r.choices[0].message.content
        assert answer == want(uncached, msgs), f"turn {i + 1}"
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert (cached > 0) == (i > 0), f"turn {i + 1}: cached_tokens {cached}"
        # From turn 2 the image is sent again with every turn (the whole conversation).
        before = counters_above(server, before, "mm_processor_cache_hits",
                                "prefix_cache_hits") if i > 0 else counters(server)
        msgs.append({"role": "assistant", "content": answer})


def test_same_image_behind_another_prompt_hits_processor_and_encoder(server, client,
                                                                      uncached):
    first = user(text_part("Zebras first."), image_part(OTHER), text_part("Describe."))
    assert ask(client, first).choices[0].message.content == want(uncached, first)
    before = counters(server)
    second = user(text_part("Quite another opening line, then:"), image_part(OTHER),
                  text_part("Now what?"))
    assert ask(client, second).choices[0].message.content == want(uncached, second)
    counters_above(server, before, "mm_processor_cache_hits", "encoder_cache_hits")


def test_a_uuid_names_an_image_the_server_holds(server, client, uncached):
    part = {**image_part(data_url(png(img(79)))), "uuid": "page-17"}
    msgs = user(part, text_part("Read it."))
    sent = ask(client, msgs).choices[0].message.content
    named = user({"type": "image_url", "image_url": {}, "uuid": "page-17"},
                 text_part("Read it."))
    assert ask(client, named).choices[0].message.content == sent == want(uncached, msgs)
    named_null = user({"type": "image_url", "image_url": None, "uuid": "page-17"},
                      text_part("Read it."))
    assert ask(client, named_null).choices[0].message.content == sent
    r = httpx.post(server.base + "/v1/chat/completions", timeout=30, json={
        "messages": user({"type": "image_url", "image_url": {}, "uuid": "never-sent"},
                         text_part("?")), "max_tokens": 2})
    assert r.status_code == 400 and "never-sent" in r.json()["error"]["message"]
    r = httpx.post(server.base + "/v1/chat/completions", timeout=30, json={
        "messages": user({"type": "image_url", "image_url": {}}, text_part("?")),
        "max_tokens": 2})
    assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]


def test_a_restarted_worker_gets_pixels_again(server, client, uncached):
    """P0 still holds the image's key, the restarted worker's store is empty: the planner
    was reset with the worker, so the pixels travel again and the answer is right."""
    msgs = user(image_part(IMAGE), text_part("Once more, after a restart."))
    assert ask(client, msgs).choices[0].message.content == want(uncached, msgs)
    old = server.engine_pid()
    os.kill(old, signal.SIGKILL)
    deadline = time.time() + 120
    while time.time() < deadline and server.worker_pids().get("colocated-0") in (None, old):
        time.sleep(0.3)
    # (a new connection: the first one has been idle as long as the restart took, and the
    # server closes a connection idle past --http-header-timeout, 10 s, which a loaded box's
    # restart can reach just as the request goes out on it; clients retry that, this one
    # is made not to)
    assert ask(server.openai_client(timeout=60), msgs).choices[0].message.content == \
        want(uncached, msgs)


def test_disagreement_is_recovered(tiny_qwen2_vl):
    """P0's mirror says a worker holds an image it does not: the worker reports the miss,
    P0 forgets the key and sends the pixels, and the request answers correctly."""
    import asyncio

    from triptych.router.router import Router
    from triptych.config import EngineConfig
    from triptych.engine.sample.sampling_params import SamplingParams as SP

    llm = LLM(tiny_qwen2_vl, block_size=4)  # in-process: its processor and the reference
    prompt = llm.processor.process_chat(user(image_part(IMAGE), text_part("Hm?")))
    want_ids = llm.generate([prompt], SP(temperature=0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)[0].outputs[0].token_ids

    async def main() -> list[int]:
        r = Router(EngineConfig(model=tiny_qwen2_vl, block_size=4), llm.get_tokenizer(),
                   processor=llm.processor)
        await r.start()
        try:
            (w,) = r.supervisor.workers
            from triptych.mmcache.lru import ProcessorCacheMirror
            mirror = r.pixels._mirrors.setdefault(w, ProcessorCacheMirror(1 << 30))
            key = prompt.mm_items[0].mm_hash
            nbytes = prompt.mm_items[0].pixel_values.numel() * 4
            mirror.plan([(key, nbytes)])  # P0 now believes the worker stored it (it did not)
            ids: list[int] = []
            async for d in r.submit("x", prompt, SP(temperature=0, max_tokens=MAX_TOKENS)):
                ids += [t for c in d.completions for t in c.token_ids]
            assert mirror.holds(key)  # sent again as data: the worker holds it now
            return ids
        finally:
            await r.shutdown()

    assert asyncio.run(main()) == want_ids


def test_shm_ring_serves_repeats_and_leaves_nothing(tiny_qwen2_vl, tmp_path, uncached):
    args = ("--block-size", "4", "--max-model-len", "1024", "--mm-processor-cache-type",
            "shm", "--mm-processor-cache-gb", "0.05", "--served-model-name", "tiny")
    s = ServerProc(tiny_qwen2_vl, tmp_path / "a.log", *args)
    pid = s.proc.pid
    try:
        c = s.openai_client(timeout=60)
        msgs = user(image_part(IMAGE), text_part("What is it?"))
        other = user(text_part("Different start."), image_part(IMAGE), text_part("Again?"))
        assert ask(c, msgs).choices[0].message.content == want(uncached, msgs)
        assert ask(c, other).choices[0].message.content == want(uncached, other)
        assert glob.glob(f"/dev/shm/triptych-{pid}-*"), "the ring lives in /dev/shm"
        counters_above(s, {"mm_processor_cache_hits": 0}, "mm_processor_cache_hits")
        s.stop(signal.SIGKILL)  # no clean shutdown: the ring stays behind ...
        s.cleanup_descendants()
        assert glob.glob(f"/dev/shm/triptych-{pid}-*")
        s2 = ServerProc(tiny_qwen2_vl, tmp_path / "b.log", *args)  # ... until the next start
        try:
            assert not glob.glob(f"/dev/shm/triptych-{pid}-*")
            pid2 = s2.proc.pid
            c2 = s2.openai_client(timeout=60)
            assert ask(c2, msgs).choices[0].message.content == want(uncached, msgs)
        finally:
            s2.stop(signal.SIGTERM)
            s2.cleanup_descendants()
        assert not [p for p in glob.glob("/dev/shm/triptych-*")
                    if re.match(rf"triptych-{pid2}-", os.path.basename(p))]
    finally:
        s.stop(signal.SIGKILL)
        s.cleanup_descendants()


def test_engine_timings_reach_metrics(server, client):
    """vLLM's engine-side histograms (the worker measures them) are exported, and this
    request moves them (before/after: earlier tests fed the same server)."""
    names = ("request_queue_time_seconds", "request_prefill_time_seconds",
             "request_decode_time_seconds", "request_inference_time_seconds",
             "time_per_prefill_token_request_seconds", "iteration_tokens_total")
    before = {n: server.metric(f"triptych:{n}_count") for n in names}
    inference = server.metric("triptych:request_inference_time_seconds_sum")
    ask(client, user(text_part("Timing check.")))
    wait_for(lambda: all(server.metric(f"triptych:{n}_count") > before[n] for n in names),
             "every engine-side histogram to count this request")
    assert server.metric("triptych:request_inference_time_seconds_sum") > inference
