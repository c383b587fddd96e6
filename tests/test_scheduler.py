"""Scheduler at tiny sizes: budget, decodes first, chunking, preemption order."""
from __future__ import annotations

from triptych.engine.kv.kv_cache_manager import KVCacheManager
from triptych.engine.request import Request, RequestStatus
from triptych.engine.sample.sampling_params import SamplingParams
from triptych.engine.scheduler import Scheduler


def make(num_blocks=16, block_size=4, budget=16, seqs=8, chunked=True, caching=False):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(kv, max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=64,
                     enable_chunked_prefill=chunked)


def req(rid: str, n: int, max_tokens: int = 8, first: int = 0) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens,
                                                                      ignore_eos=True))


def run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = {r.request_id: token for r, n in out.scheduled if r.request_id in out.sampling}
    s.update_from_output(out, sampled)
    return [(r.request_id, n) for r, n in out.scheduled], out


def test_budget_and_chunked_prefill():
    s = make(budget=10)
    s.add_request(req("a", 6))
    s.add_request(req("b", 9))
    got, _ = run_step(s)
    assert got == [("a", 6), ("b", 4)]  # b chunked to the remaining budget
    got, _ = run_step(s)
    assert got == [("a", 1), ("b", 5)]  # a's decode first, then b's remaining prompt
    assert s.requests["b"].num_output_tokens == 1
    s.kv.check_integrity()


def test_decodes_before_partial_prefills():
    s = make(budget=8)
    s.add_request(req("long", 20))
    run_step(s)  # long: 8 of 20
    s.add_request(req("short", 2))
    got, _ = run_step(s)  # long: 16 of 20; short admitted? budget used by long
    assert got == [("long", 8)]
    got, _ = run_step(s)
    assert got == [("long", 4), ("short", 2)]
    got, _ = run_step(s)
    assert got[0][1] == 1 and got[1][1] == 1  # both decoding now


def test_no_chunking_waits_for_budget():
    s = make(budget=8, chunked=False)
    s.add_request(req("a", 6))
    s.add_request(req("b", 6))
    got, _ = run_step(s)
    assert got == [("a", 6)]  # b does not fit whole and waits
    got, _ = run_step(s)
    assert got == [("a", 1), ("b", 6)]


def test_block_ids_travel_with_the_schedule():
    s = make(num_blocks=8, block_size=4, budget=32)
    s.add_request(req("a", 6))
    s.add_request(req("b", 3, first=50))
    _, out = run_step(s)
    assert out.block_ids == {"a": [0, 1], "b": [2]}  # exact ids: fresh pool, in order
    sub = out.subset(out.scheduled[1:])
    assert sub.block_ids == {"b": [2]} and sub.num_scheduled_tokens == 3
    _, out = run_step(s)
    assert out.block_ids == {"a": [0, 1], "b": [2]}  # decodes: 7 and 4 tokens still fit


def test_max_num_seqs():
    s = make(seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 2))
    got, _ = run_step(s)
    assert [g[0] for g in got] == ["r0", "r1"]
    assert len(s.waiting) == 1


def test_preemption_takes_latest_admitted_and_recomputes():
    # 4 blocks of 4 tokens; two requests of 7 tokens take 2 blocks each; growth forces preemption.
    s = make(num_blocks=4, block_size=4, budget=32)
    s.add_request(req("a", 7, max_tokens=6))
    s.add_request(req("b", 7, max_tokens=6, first=100))
    run_step(s)  # both prefilled: 7 tokens computed, 1 sampled
    run_step(s)  # token 8 of each still fits in 2 blocks
    got, out = run_step(s)  # token 9 needs a 3rd block: b (admitted last) is preempted
    b = s.requests["b"]
    assert out.preempted == [b] and out.preempted_ids == ["b"]
    assert got == [("a", 1)]
    assert out.block_ids == {"a": s.kv.block_ids("a")} and len(out.block_ids["a"]) == 3
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.num_preemptions_total == 1 and s.waiting[0] is b
    s.kv.check_integrity()
    # Run to completion: b recomputes prompt + its output so far, then continues.
    for _ in range(30):
        if not s.num_unfinished:
            break
        run_step(s)
    assert not s.num_unfinished
    assert b.num_output_tokens == 6 and b.status == RequestStatus.FINISHED_LENGTH
    assert s.kv.pool.num_free_blocks == 4


def test_stop_token_and_max_tokens():
    s = make()
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=5, stop_token_ids=[42]), eos_token_id=0)
    s.add_request(r)
    run_step(s, token=5)
    run_step(s, token=42)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 42
    r2 = Request("b", [1, 2, 3], SamplingParams(max_tokens=2), eos_token_id=0)
    s.add_request(r2)
    run_step(s, token=5)
    run_step(s, token=5)
    assert r2.status == RequestStatus.FINISHED_LENGTH and r2.output_token_ids == [5, 5]
    r3 = Request("c", [1, 2, 3], SamplingParams(max_tokens=9), eos_token_id=0)
    s.add_request(r3)
    run_step(s, token=0)
    assert r3.status == RequestStatus.FINISHED_STOPPED
    assert s.kv.pool.num_free_blocks == 16


def test_prefilled_request_enters_running():
    s = make(num_blocks=8)
    r = req("x", 8)
    # Blocks 3 and 5 hold the imported prompt KV.
    r.num_computed_tokens = 8
    r.output_token_ids.append(11)  # the first token, sampled by the prefill worker
    s.kv.pool.touch([s.kv.pool.blocks[3], s.kv.pool.blocks[5]])
    s.add_prefilled_request(r, [3, 5])
    got, out = run_step(s)
    assert got == [("x", 1)]
    assert s.kv.block_ids("x")[:2] == [3, 5]
    assert out.block_ids["x"][:2] == [3, 5]  # the runner's block table comes with the step


def imported(s: Scheduler, r: Request, blocks: list[int]) -> None:
    """``r`` admitted as a KV import: its prompt's KV in ``blocks``, its first token
    sampled by the prefill side."""
    r.num_computed_tokens = r.num_tokens
    r.output_token_ids.append(11)
    s.kv.pool.touch([s.kv.pool.blocks[i] for i in blocks])
    s.add_prefilled_request(r, blocks)


def test_prefilled_requests_wait_for_a_seat():
    """KV imports beyond max_num_seqs wait (their blocks held) and take the first seats
    freed, before waiting prompts: the batch never holds more than max_num_seqs."""
    s = make(num_blocks=16, seqs=2, budget=32)
    for k, rid in enumerate("xyz"):
        imported(s, req(rid, 4, max_tokens=2 + k), [k])
    s.add_request(req("w", 3, first=50))
    assert s.num_unfinished == 4 and [r.request_id for r in s.prefilled] == ["z"]
    got, _ = run_step(s)
    assert got == [("x", 1), ("y", 1)]  # x finishes (2 tokens)
    assert s.requests.get("x") is None
    got, _ = run_step(s)
    assert got == [("y", 1), ("z", 1)]  # z before the waiting prompt w
    assert not s.prefilled and s.kv.block_ids("z")[:1] == [2]
    s.finish(s.requests["z"], RequestStatus.FINISHED_ABORTED)
    got, _ = run_step(s)
    assert got == [("w", 3)]  # y finished last step; w takes a freed seat
    s.kv.check_integrity()


def test_an_aborted_prefilled_request_leaves_the_seat_queue():
    s = make(num_blocks=8, seqs=1)
    for k, rid in enumerate("ab"):
        imported(s, req(rid, 4), [k])
    s.finish(s.requests["b"], RequestStatus.FINISHED_ABORTED)
    assert not s.prefilled and s.num_unfinished == 1 and s.kv.pool.num_free_blocks == 7


def test_hand_off_after_first_token_keeps_blocks():
    s = make(num_blocks=8)
    r = req("p", 6)
    r.hand_off_after_prefill = True
    s.add_request(r)
    run_step(s, token=9)
    assert r.status == RequestStatus.FINISHED_HANDED_OFF and r.output_token_ids == [9]
    assert s.kv.handed_off["p"] and s.kv.pool.num_free_blocks == 6  # still held
    s.kv.release_blocks("p")
    assert s.kv.pool.num_free_blocks == 8
    s.kv.check_integrity()


def test_preemption_warning_names_the_knobs(caplog):
    s = make(num_blocks=4, block_size=4, budget=32)
    s.add_request(req("a", 7, max_tokens=6))
    s.add_request(req("b", 7, max_tokens=6, first=100))
    with caplog.at_level("WARNING", logger="triptych.scheduler"):
        for _ in range(3):
            run_step(s)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1  # once, not every step
    for knob in ("kv_cache_memory", "gpu_memory_utilization", "max_num_seqs",
                 "max_num_batched_tokens"):
        assert knob in msgs[0]


def test_prompt_logprobs_prompts_come_in_bounded_chunks():
    """A prompt whose logprobs are asked makes [tokens, vocab] fp32 logits in its step
    (~3 GB for 2,048 tokens of a 152k vocab): it is given at most PROMPT_LOGPROBS_CHUNK
    tokens a step (chunked prefill off or not), what the profile run measures."""
    from triptych.engine.scheduler import PROMPT_LOGPROBS_CHUNK as C

    for chunked in (True, False):
        kv = KVCacheManager(2000, 4, False)
        s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=4 * C, max_model_len=8 * C,
                      enable_chunked_prefill=chunked)
        r = Request("p", list(range(2 * C + 5)), SamplingParams(max_tokens=2, prompt_logprobs=1))
        s.add_request(r)
        s.add_request(req("q", 3 * C))  # a neighbour without them fills the rest
        got = [{x.request_id: n for x, n in s.schedule().scheduled} for _ in range(3)]
        assert got[0] == {"p": C, "q": 3 * C}
        assert got[1]["p"] == C and got[2]["p"] == 5 and got[2]["q"] == 1


def test_a_decode_with_room_in_its_blocks_copies_nothing():
    """A decode step whose token fits the request's last block allocates nothing and keeps
    its block list (no copy of it, nor of its token ids for hashing, per step); a block
    filled is published once, its hash chain extended only then."""
    kv = KVCacheManager(64, 4, True)
    r = Request("r", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=16, ignore_eos=True))
    assert kv.allocate_slots(r, 6) and len(kv.req_blocks["r"]) == 2
    r.num_computed_tokens = 6
    kv.cache_blocks(r, 6)
    assert len(r.block_hashes) == 1 and kv.num_published["r"] == 1
    held = kv.req_blocks["r"]
    r.output_token_ids.append(7)
    assert kv.allocate_slots(r, 1) == [] and kv.req_blocks["r"] is held  # (7 of 8 slots)
    r.num_computed_tokens = 7
    kv.cache_blocks(r, 7)
    assert len(r.block_hashes) == 1
    r.output_token_ids.append(8)
    assert kv.allocate_slots(r, 1) == [] and kv.req_blocks["r"] is held
    r.num_computed_tokens = 8
    kv.cache_blocks(r, 8)  # the second block is full: published, hashed
    assert len(r.block_hashes) == 2 and kv.num_published["r"] == 2
    r.output_token_ids.append(9)
    assert len(kv.allocate_slots(r, 1)) == 1 and len(kv.req_blocks["r"]) == 3
    kv.check_integrity()
