"""What the router promises when workers fail or forget, against real worker processes:
a child whose workers keep dying is failed after MAX_MIGRATIONS moves (not run forever); a
prefilling worker that lost an image's embeddings (NeedEmbeddings) gets them encoded again
and the request answers as usual; a pool with no live worker ends the requests that need it
at once (the server's 503) while the others go on; the supervisor's restart backoff doubles
for a worker that keeps failing and starts over once one ran long enough; /health's
``served`` counts what every pool's workers served.

The Router runs on this test's event loop (as in test_cache_integration), so the tests wait
on its own state, polled with generous deadlines that only guard against hangs."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import pytest
from triptych import LLM, SamplingParams
from triptych.config import EngineConfig
from triptych.router.router import MAX_MIGRATIONS, EngineDeadError, Router

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import image_chat, img, text_part, user

DEADLINE_S = 120.0  # against hangs only; nothing here asserts a duration


@pytest.fixture(scope="module")
def offline(tiny_qwen2_vl):
    """The in-process engine: the processor that makes prompts, and the reference outputs."""
    return LLM(tiny_qwen2_vl, block_size=4, max_model_len=4096)


def reference(offline: LLM, prompt: Any, sp: SamplingParams) -> list[int]:
    return list(offline.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids)


async def wait_until(pred: Callable[[], Any], what: str, timeout: float = DEADLINE_S) -> Any:
    """Poll ``pred`` on the router's loop until it returns something true."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not (got := pred()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
    return got


async def generate(r: Router, rid: str, prompt: Any, sp: SamplingParams) -> list[int]:
    last = None
    async for out in r.outputs_of(rid, prompt, sp, stream=False):
        last = out
    assert last is not None and last.finished
    return list(last.outputs[0].token_ids)


def workers(r: Router, pool: str) -> list[dict]:
    return r.health()["pools"][pool]["workers"]


def served(r: Router) -> dict[str, int]:
    return {pool: sum(w["served"] for w in workers(r, pool)) for pool in r.layout.pools}


async def with_router(config: EngineConfig, offline: LLM,
                      body: Callable[[Router], Any]) -> Any:
    r = Router(config, offline.get_tokenizer(), processor=offline.processor)
    await r.start()
    try:
        return await body(r)
    finally:
        await r.shutdown()


def test_lost_embeddings_are_encoded_again_and_every_pool_counts_what_it_served(
        tiny_qwen2_vl, offline):
    """E+P+D with no encoder cache: the prefill worker keeps no embedding, so the repeat of
    an image the router believes it holds comes back as NeedEmbeddings; the router has the
    encode pool send it again, and the request answers as the first did, without a
    migration. Each pool's ``served`` counts the requests it did its part of (encode and
    prefill workers used to show 0)."""
    prompt = offline.processor.process_chat(image_chat("What is in it?", img(7, 56, 84)))
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = reference(offline, prompt, sp)
    config = EngineConfig(model=tiny_qwen2_vl, block_size=4, max_model_len=512,
                          encode_workers=1, prefill_workers=1, decode_workers=1,
                          encoder_cache_size=0)

    async def body(r: Router) -> None:
        assert await generate(r, "first", prompt, sp) == want
        # EncodeDone may come after the request's last token: wait for it.
        await wait_until(lambda: served(r) == {"encode": 1, "prefill": 1, "decode": 1},
                         "each pool to count the first request")
        assert await generate(r, "again", prompt, sp) == want
        await wait_until(lambda: served(r)["encode"] == 2, "the second encode")
        assert served(r) == {"encode": 2, "prefill": 2, "decode": 2}
        assert r.migrations_total == 0  # answered by encoding again, not by a re-run

    asyncio.run(with_router(config, offline, body))


def test_a_child_whose_workers_keep_dying_fails_after_the_migration_limit(
        tiny_qwen2_vl, offline):
    """Three colocated replicas; every worker the request lands on is killed. It moves
    MAX_MIGRATIONS times, then fails with an error that says why, instead of moving on."""
    prompt = offline.processor.process_chat(user(text_part("Tell me a very long story.")))
    sp = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
    config = EngineConfig(model=tiny_qwen2_vl, block_size=4, max_model_len=4096,
                          data_parallel_size=MAX_MIGRATIONS + 1)

    async def body(r: Router) -> None:
        run = asyncio.ensure_future(generate(r, "doomed", prompt, sp))
        killed: list[int] = []

        def holder() -> dict | None:
            return next((w for w in workers(r, "colocated") if w["state"] == "up"
                         and w["requests"] and w["pid"] not in killed), None)

        for _ in range(MAX_MIGRATIONS + 1):
            w = await wait_until(holder, "a live worker to hold the request")
            os.kill(w["pid"], signal.SIGKILL)
            killed.append(w["pid"])
        with pytest.raises(EngineDeadError, match="failed repeatedly"):
            await asyncio.wait_for(run, DEADLINE_S)
        assert r.migrations_total == MAX_MIGRATIONS
        assert r.num_in_flight == 0

    asyncio.run(with_router(config, offline, body))


def test_a_pool_without_a_live_worker_ends_the_requests_that_need_it(tiny_qwen2_vl, offline):
    """E+PD with the encode worker killed: /health says unavailable and an image request
    ends at once with EngineDeadError (the server's 503); a text request, which never
    touches the encode pool, is served meanwhile; once the worker is back, images are too."""
    image = offline.processor.process_chat(image_chat("And this?", img(8, 56, 56)))
    text = offline.processor.process_chat(user(text_part("Only words.")))
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want_image, want_text = reference(offline, image, sp), reference(offline, text, sp)
    config = EngineConfig(model=tiny_qwen2_vl, block_size=4, max_model_len=512,
                          encode_workers=1, decode_workers=1)

    async def body(r: Router) -> None:
        (encoder,) = workers(r, "encode")
        os.kill(encoder["pid"], signal.SIGKILL)
        await wait_until(lambda: workers(r, "encode")[0]["state"] != "up",
                         "the supervisor to notice the death")
        # NOTE: nothing is awaited from here to the pool check in outputs_of, so the
        # restarted worker cannot come up in between.
        assert r.health()["status"] == "unavailable"
        with pytest.raises(EngineDeadError, match="no live worker in the encode pool"):
            await generate(r, "image", image, sp)
        assert await generate(r, "text", text, sp) == want_text
        await wait_until(lambda: workers(r, "encode")[0]["state"] == "up", "the restart")
        assert await generate(r, "image-again", image, sp) == want_image
        assert workers(r, "encode")[0]["restarts"] == 1

    asyncio.run(with_router(config, offline, body))


def test_restart_backoff_doubles_for_a_failing_worker_and_starts_over_after_a_stable_run(
        tmp_path, monkeypatch):
    """A worker whose every incarnation fails at start: the supervisor waits 0.5 s, then
    1 s, then 2 s before restarting it. An incarnation that lived longer than STABLE_S
    (here: any, once it is set to 0) resets the backoff to its start."""
    from triptych.router import supervisor as sup
    from triptych.router.handle import WorkerHandle

    async def main() -> list[tuple[int, int, float]]:
        exits: list[tuple[int, int, float]] = []  # (incarnation, exit code, backoff)
        done = asyncio.Event()

        def on_exit(w: WorkerHandle, code: int) -> None:
            exits.append((w.incarnation, code, w.backoff_s))
            if len(exits) == 3:  # from now on every incarnation counts as a stable one
                monkeypatch.setattr(sup, "STABLE_S", 0.0)
            if len(exits) == 4:
                done.set()

        s = sup.Supervisor(f"ipc://{tmp_path}/nowhere", None, on_exit)
        # A knob EngineConfig does not have: the worker fails as it reads its config.
        w = WorkerHandle("decode", 0, {"model": "x", "no_such_knob": 1})
        s.spawn(w)
        watcher = asyncio.create_task(s.watch())
        try:
            await asyncio.wait_for(done.wait(), 4 * DEADLINE_S)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await s.stop_all(grace_s=10)
        assert s.restarts_total == 3 and w.restarts == 3
        return exits

    exits = asyncio.run(main())
    assert [i for i, _, _ in exits] == [0, 1, 2, 3]
    assert all(code != 0 for _, code, _ in exits)
    assert [b for _, _, b in exits] == [0.5, 1.0, 2.0, 0.5]
