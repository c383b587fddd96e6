"""Tenant shares of a step (engine/tenant_share.py): the busiest tenant is held to a cap
while others have work, its sequences take turns, its prompt chunks are cut, it sits
out the steps that measure the others alone; a tenant alone, or tenants asking alike,
keep whole steps. Then the engine: the same greedy tokens with shares as without, and a
resting structured-output request keeps its matcher (nothing replayed)."""
from __future__ import annotations

import pytest
from triptych.engine import tenant_share
from triptych.engine.kv.kv_cache_manager import KVCacheManager
from triptych.engine.request import Request
from triptych.engine.sample.sampling_params import SamplingParams
from triptych.engine.scheduler import Scheduler
from triptych.engine.structured.structured_params import StructuredOutputsParams
from triptych.engine.tenant_share import TenantShares, size


@pytest.fixture(autouse=True)
def fixed_cap(request, monkeypatch):
    """The cap stays where a test puts it (these steps take microseconds: measured, they
    would only ever grow it); the controller's own test measures."""
    if "measured" not in request.node.name:
        monkeypatch.setattr(tenant_share, "GROW", 1.0)
        monkeypatch.setattr(tenant_share, "SHRINK", 1.0)


def make(budget=64, seqs=16, cap=None, explore=0):
    s = Scheduler(KVCacheManager(256, 4, False), max_num_seqs=seqs,
                  max_num_batched_tokens=budget, max_model_len=256, tenant_step_share=0.5)
    s.shares.explore_every = explore
    if cap is not None:  # (as the controller would have brought it to)
        s.shares.cap, s.shares.alone_s = cap, 1e-3
    return s


def req(rid: str, tenant: str | None, n: int = 4, max_tokens: int = 64) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens,
                                                              ignore_eos=True, tenant=tenant))


def step(s: Scheduler) -> dict[str, int]:
    out = s.schedule()
    s.update_from_output(out, {r.request_id: 7 for r, _ in out.scheduled
                               if r.request_id in out.sampling})
    return {r.request_id: n for r, n in out.scheduled}


def test_the_busiest_tenant_takes_turns_and_the_other_runs_every_step():
    s = make(cap=6.0)  # two of alice's short decodes a step (each ~5.01, a token and its
    for i in range(4):  # row: the second starts under the cap)
        s.add_request(req(f"a{i}", "alice"))
    step(s)  # (alice alone: all four prefill, no shares)
    s.add_request(req("b", "bob"))
    got = step(s)  # bob's prompt (4 tokens and a row: 8.01) is held against alice's four
    assert len(got) == 3 and got["b"] == 4  # decodes (20.02): she is held to his ask, two
    # of hers start under it (a decode's row weighs more than a prompt token)
    served: dict[str, list[int]] = {f"a{i}": [] for i in range(4)}
    for k in range(4 * tenant_share.TURN_STEPS):
        got = step(s)
        assert "b" in got, (k, got)  # bob: every step
        alice = [r for r in got if r.startswith("a")]
        assert len(alice) == 2, (k, got)  # alice: her cap's worth
        for r in alice:
            served[r].append(k)
    for r, ks in served.items():  # hers take turns of a few steps: none waits much longer
        waits = [b - a for a, b in zip([-1] + ks, ks + [4 * tenant_share.TURN_STEPS])]
        assert ks and max(waits) <= tenant_share.TURN_STEPS + 2, (r, ks)
    assert s.shares.deferrals_total >= 2 * 4 * tenant_share.TURN_STEPS
    s.kv.check_integrity()


def test_a_held_tenants_turns_last_turn_steps_and_survive_a_step_sat_out():
    """Held to one sequence a step, alice's six run in turns of TURN_STEPS steps each (the
    same sequence step after step, then the longest held: a row rejoining the batch is a
    rewrite, so turns do not change every step), through the steps she sits out (one in
    a few here: a turn is counted in the steps run, not cut short by a rest)."""
    s = make(budget=1024, cap=1.0, explore=2)
    for i in range(6):
        s.add_request(req(f"a{i}", "alice", n=100, max_tokens=120))  # (each a little more
    step(s)  # than bob's one: one of hers fills her cap)
    s.add_request(req("b", "bob", max_tokens=120))
    step(s)  # (bob's prompt: alice runs up to its size)
    runs: list[str] = []
    for _ in range(12 * tenant_share.TURN_STEPS):
        got = step(s)
        assert "b" in got
        alice = [r for r in got if r.startswith("a")]
        assert len(alice) <= 1, got
        runs += alice
    turns = [runs[0]]
    lengths = [0]
    for r in runs:
        if r != turns[-1]:
            turns.append(r)
            lengths.append(0)
        lengths[-1] += 1
    # (the first six turns began in the steps before: alice alone, bob's prompt)
    assert len(turns) >= 8 and all(n == tenant_share.TURN_STEPS for n in lengths[6:-1]), \
        (turns, lengths)
    assert set(turns) == {f"a{i}" for i in range(6)}  # each had its turn
    s.kv.check_integrity()


def test_a_tenant_alone_or_tenants_asking_alike_keep_whole_steps():
    s = make(cap=1.0)
    for i in range(4):
        s.add_request(req(f"a{i}", "alice"))
    assert s.tenants == {"alice": 4}  # one tenant: no shares, no walk over the queues
    for _ in range(3):
        assert len(step(s)) == 4  # alone: no cap
    for i in range(4):
        s.add_request(req(f"b{i}", "bob"))
    got = step(s)  # bob's prompts (16 tokens, four rows: 32) are held to alice's ask (four
    # decodes: 20.02): two start whole, the next two find no room for a token and a row
    assert sum(n for r, n in got.items() if r.startswith("b")) == 8
    for _ in range(3):
        step(s)
    for _ in range(3):
        assert len(step(s)) == 8  # alike: each held to the other's ask, i.e. all of it


def test_shares_off_and_one_anonymous_tenant_change_nothing():
    for tenant, share in ((None, 0.5), ("alice", 0.0)):
        s = make(cap=1.0)
        s.shares.share = share
        for i in range(4):
            s.add_request(req(f"a{i}", tenant))
        s.add_request(req("b", "bob" if share == 0 else None))
        for _ in range(4):
            assert len(step(s)) == 5
        assert s.shares.deferrals_total == 0


def test_a_prompt_over_the_cap_is_cut_and_others_waiting_behind_it_go_first():
    s = make(cap=14.0)
    s.add_request(req("b0", "bob"))
    step(s)
    s.add_request(req("a0", "alice", n=40))
    got = step(s)
    assert got["b0"] == 1 and got["a0"] == 9  # 9 + 4 + 45/1024 <= 14 < 10 + 4 + 55/1024
    assert size(0, 9) <= 14 < size(0, 10)
    # alice has her cap's worth running: her next prompt waits, bob's behind it goes in
    s.add_request(req("a1", "alice", n=40))
    s.add_request(req("b1", "bob"))
    got = step(s)
    assert "a1" not in got and got["b1"] == 4 and got["a0"] == 9
    assert [r.request_id for r in s.waiting] == ["a1"]  # its place kept


def test_the_busiest_sits_out_the_steps_that_measure_the_others_alone():
    s = make(cap=100.0, explore=1)
    for i in range(6):
        s.add_request(req(f"a{i}", "alice"))
    step(s)
    s.add_request(req("b", "bob"))
    assert step(s) == {"b": 4}  # alice asks more (six decodes against a prompt of 4)
    assert step(s) == {"b": 1}
    s.shares.explore_every = 0
    assert len(step(s)) == 7  # (a step with her: under a cap of 100, all of hers)


def test_the_cap_follows_the_measured_bound():
    sh = TenantShares(0.5)
    sh.explore_every = 0
    sh.alone_s, sh.cap = 1e-3, 8.0
    demands = {"alice": 16 * size(100, 1), "bob": size(3, 1)}
    t = 0.0
    for _ in range(5):  # steps with alice take 2 ms > 1.5 x 1 ms: the cap shrinks
        assert sh.plan(demands) is not None
        sh.scheduled(t)
        t += 2e-3
    assert sh.cap < 8.0 * 0.8 ** 3
    low = sh.cap
    for _ in range(40):  # then 1.2 ms: under the bound, it grows back
        sh.plan(demands)
        sh.scheduled(t)
        t += 1.2e-3
    assert sh.cap > low
    sh.plan({"alice": 16 * size(100, 1)})
    sh.scheduled(t + 5)  # (alone: no shares, nothing learnt)
    assert sh._last is None
    # steps with her cost bob little (a GPU): she sits out fewer steps, down to 1 in 64
    sh2 = TenantShares(0.5)
    sh2.alone_s, sh2.with_s, sh2.cap = 1e-3, 1.1e-3, 8.0
    for k in range(4):
        sh2._kind = "alone"
        sh2.scheduled(100.0 + 10 * k)  # (pairs further apart than an idle gap)
        sh2.scheduled(100.0 + 10 * k + 1e-3)  # an alone step of 1 ms: 1.1 < 1.25 x 1 ms
    assert sh2.stretch == tenant_share.MAX_STRETCH
    sh2.with_s = 1.4e-3  # near the bound again: back to one in EXPLORE_EVERY
    sh2._kind = "alone"
    sh2.scheduled(200.0)
    sh2.scheduled(200.0 + 1e-3)
    assert sh2.stretch == 1
    sh.explore_every, alone = 1, sh.alone_s
    sh.plan(demands)  # a step without alice in which bob's request could not start:
    sh.scheduled(t + 5.0001, ran=False)  # empty, it says nothing of his steps alone
    sh.scheduled(t + 5.0002)
    assert sh.alone_s == alone


def test_the_held_tenant_stays_held_a_moment_after_the_others_leave():
    """LINGER_S: bob's next request, sent as his last one ends, finds a step of alice's
    cap in flight, not one of all her sequences; after LINGER_S she has whole steps."""
    s = make(cap=6.0)  # (two of her decodes)
    for i in range(4):
        s.add_request(req(f"a{i}", "alice"))
    step(s)
    s.add_request(req("b", "bob", max_tokens=2))
    while "b" in {r.request_id for r in s.running} | {r.request_id for r in s.waiting}:
        step(s)
    assert s.tenants == {"alice": 4}
    for _ in range(3):  # alone again, within LINGER_S: still her cap's worth
        assert len(step(s)) == 2
    s.shares._held_at -= tenant_share.LINGER_S
    assert len(step(s)) == 4  # then whole steps


def test_a_first_cap_starts_from_the_others_ask():
    """The first contention holds the busiest to what the others ask (then the measured
    bound grows it), not to all it asks (then ~20 steps of shrinking at 0.8 a step)."""
    sh = TenantShares(0.5)
    sh.explore_every = 0
    shares = sh.plan({"alice": 128 * size(10, 1), "bob": size(3, 1)})
    assert shares is not None and sh.cap == pytest.approx(max(1.0, size(3, 1)))


def run_two_tenants(share: float, async_scheduling: bool = False
                    ) -> tuple[dict[str, list[int]], int]:
    from triptych.config import EngineConfig
    from triptych.llm_engine import LLMEngine
    from triptych.models.demo import demo_checkpoint

    core = LLMEngine(EngineConfig.from_kwargs(model=demo_checkpoint(), tenant_step_share=share,
                                              async_scheduling=async_scheduling)).core
    assert core.async_scheduling == async_scheduling
    shares = core.scheduler.shares
    shares.explore_every = 3  # alice sits out a step in three (on top of her cap)
    shares.cap, shares.alone_s = 2.0, 1e-3
    for i in range(6):
        sp = SamplingParams(max_tokens=40, temperature=0, tenant="alice",
                            structured_outputs=StructuredOutputsParams(regex="[a-z ]{10,40}")) if i == 0 else \
            SamplingParams(max_tokens=40, min_tokens=40, temperature=0, tenant="alice")
        core.add_request(f"a{i}", [5 + i, 6, 7, 8 + i], sp)
    core.add_request("b", [9, 10, 11], SamplingParams(max_tokens=40, min_tokens=40,
                                                      temperature=0, tenant="bob"))
    tokens: dict[str, list[int]] = {}
    matcher = None
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        grammars = core.runner.batch.grammars
        if "a0" in grammars:
            matcher = matcher or grammars._matchers["a0"]
            assert grammars._matchers["a0"] is matcher  # resting replays nothing
    assert matcher is not None and len(tokens) == 7
    return tokens, shares.deferrals_total


def test_greedy_tokens_are_the_same_with_shares():
    alone, none = run_two_tenants(0.0)
    shared, deferred = run_two_tenants(0.5)
    assert none == 0 and deferred > 20
    assert shared == alone
    # async scheduling: a sequence rests while its last token is still in flight (the
    # token reaches its matcher and counts through the resting entry)
    shared_async, deferred = run_two_tenants(0.5, async_scheduling=True)
    assert deferred > 20 and shared_async == alone


def test_a_tenant_holding_every_seat_gives_one_back_to_another_waiting():
    s = make(seqs=4, cap=100.0)
    for i in range(4):
        s.add_request(req(f"a{i}", "alice", max_tokens=6))
    step(s)
    s.add_request(req("b", "bob", max_tokens=6))
    out = s.schedule()  # every seat is alice's: her newest gives its seat back, and bob
    assert [r.request_id for r in out.preempted] == ["a3"]  # takes it in the same step
    assert {r.request_id: n for r, n in out.scheduled}["b"] == 4
    s.update_from_output(out, {r.request_id: 7 for r, _ in out.scheduled
                               if r.request_id in out.sampling})
    assert "a3" not in step(s)  # a3 waits at the front while alice holds her part
    assert [r.request_id for r in s.waiting] == ["a3"]
    assert s.shares.seat_preemptions_total == 1
    seen = set()
    while s.num_unfinished:
        seen |= set(step(s))
    assert "a3" in seen and s.shares.seat_preemptions_total == 1  # (no churn after)
    assert not s.tenants  # (the count of each tenant's requests follows them out)
    s.kv.check_integrity()
