"""InputBatch bookkeeping: rows, holes, compaction order, growth, and the flat inputs of
new, decoding, imported (KV computed elsewhere) and resumed (preempted) requests."""
from __future__ import annotations

import numpy as np
from triptych.engine.request import MMItem, Request
from triptych.engine.runner.input_batch import InputBatch
from triptych.engine.sample.sampling_params import SamplingParams
from triptych.models.mrope import compute_mrope_positions

BS = 4


def req(rid: str, n: int, outputs: tuple[int, ...] = (), computed: int = 0,
        image: tuple[int, int] | None = None) -> Request:
    """A request with prompt ids 100*k + i; ``image`` = (offset, tokens) of a 1 x 4 x k patch grid."""
    ids = [100 * (ord(rid[0]) - 96) + i for i in range(n)]
    items = []
    if image is not None:
        off, length = image
        items = [MMItem("image", "h" + rid, off, length, (1, 4, length))]
    pos, delta = compute_mrope_positions(n, items, 2, None)
    r = Request(rid, ids, SamplingParams(), items, mrope_positions=pos, mrope_delta=delta,
                num_computed_tokens=computed)
    r.output_token_ids.extend(outputs)
    return r


def rows(b: InputBatch) -> dict[str, int]:
    return dict(sorted(b.index.items(), key=lambda kv: kv[1]))


def test_add_remove_and_hole_reuse():
    b = InputBatch(BS, max_reqs=2)
    for rid, n in (("a", 5), ("b", 3), ("c", 9)):  # the third add grows the rows
        b.add(req(rid, n), list(range(10 * len(b), 10 * len(b) + -(-n // BS))))
    assert rows(b) == {"a": 0, "b": 1, "c": 2} and b.token_ids.shape[0] >= 3
    assert b.token_ids[2, :9].tolist() == [300 + i for i in range(9)]
    assert b.block_table[2, :3].tolist() == [20, 21, 22] and b.num_blocks[2] == 3
    assert b.remove("b") == 1 and b.remove("b") is None
    b.add(req("d", 2), [7])  # a hole is reused before the batch grows
    assert rows(b) == {"a": 0, "d": 1, "c": 2}
    b.check_integrity()


def test_condense_moves_the_last_rows_into_the_lowest_holes():
    b = InputBatch(BS)
    for i, rid in enumerate("abcde"):
        b.add(req(rid, 3 + i), [i])
    b.remove("a")
    b.remove("c")
    b.condense()
    # e (row 4) fills hole 0, d (row 3) fills hole 2; b keeps its row
    assert rows(b) == {"e": 0, "b": 1, "d": 2} and b.num_reqs == 3
    assert b.token_ids[0, :7].tolist() == [500 + i for i in range(7)] and b.num_tokens[0] == 7
    assert b.block_table[0, 0] == 4 and b.block_table[2, 0] == 3
    assert b.reqs[3] is None and b.reqs[4] is None
    b.remove("d")  # a hole at the end: nothing moves, the batch shrinks
    b.condense()
    assert rows(b) == {"e": 0, "b": 1} and b.num_reqs == 2
    b.check_integrity()


def test_block_table_and_token_growth():
    b = InputBatch(BS, max_tokens=4, max_blocks=2)
    b.add(req("a", 3), [5])
    b.set_blocks(0, [5, 9, 11, 2, 8])  # appends only the new ones, growing the columns
    assert b.block_table[0, :5].tolist() == [5, 9, 11, 2, 8] and b.num_blocks[0] == 5
    for t in range(10):
        b.append_token(0, 1000 + t)
    assert b.num_tokens[0] == 13 and b.token_ids[0, 3:13].tolist() == list(range(1000, 1010))
    assert b.token_ids[0, :3].tolist() == [100, 101, 102]


def test_prepare_mixed_decode_and_prefill_chunk():
    b = InputBatch(BS)
    a = req("a", 6, outputs=(42,), computed=6)  # decode: the token after the prompt
    c = req("c", 10)  # prefill chunk 0..4 of 10: not sampled
    b.add(a, [3, 8])
    b.add(c, [1, 6, 0])
    b.condense()
    inp = b.prepare(np.array([1, 4]))
    assert inp.input_ids.tolist() == [42, 300, 301, 302, 303]
    assert inp.cu_seqlens_q.tolist() == [0, 1, 5] and inp.seq_lens.tolist() == [7, 4]
    assert inp.slot_mapping.tolist() == [8 * BS + 2, 4, 5, 6, 7]
    assert inp.positions[:, 0].tolist() == [6, 6, 6] and inp.max_query_len == 4
    assert inp.sample_rows.tolist() == [0] and inp.logits_index.tolist() == [0]
    assert inp.block_tables.shape == (2, 2) and inp.block_tables.flags.c_contiguous
    b.append_token(0, 43)
    b.advance(np.array([1, 4]))
    inp = b.prepare(np.array([1, 6]))  # the rest of c's prompt: sampled now
    assert inp.input_ids.tolist() == [43] + [304 + i for i in range(6)]
    assert inp.sample_rows.tolist() == [0, 1] and inp.logits_index.tolist() == [0, 6]
    assert inp.slot_mapping[1:].tolist() == [24, 25, 26, 27, 0, 1]  # blocks 6, then 0


def test_imported_and_resumed_requests_with_image_positions():
    # imported: prompt KV came from a prefill worker, first token sampled there
    imp = req("a", 12, outputs=(77,), computed=12, image=(2, 4))
    # resumed after preemption: KV gone, two output tokens to recompute with the prompt
    res = req("b", 12, outputs=(5, 6), computed=0, image=(3, 4))
    b = InputBatch(BS)
    b.add(imp, [0, 1, 2, 3])
    b.add(res, [4, 5, 6, 7])
    b.condense()
    inp = b.prepare(np.array([1, 14]))
    assert inp.input_ids[0] == 77 and inp.slot_mapping[0] == 3 * BS  # token 12: block 3
    assert inp.positions[:, 0].tolist() == [12 + imp.mrope_delta] * 3
    assert imp.mrope_delta != 0  # the image makes decode positions differ from the index
    flat = inp.positions[:, 1:]
    assert np.array_equal(flat[:, :12], res.mrope_positions)
    assert flat[:, 12:].tolist() == [[12 + res.mrope_delta, 13 + res.mrope_delta]] * 3
    assert inp.input_ids[1:].tolist() == res.prompt_token_ids + [5, 6]
    assert inp.sample_rows.tolist() == [0, 1]


def test_decodes_come_first_with_their_rows():
    """A mixed step's rows of one token are moved before the longer ones (one swap each),
    every array of a row moving with it, so attention runs them as one leading slice; the
    flat inputs are the same tokens, decodes first."""
    b = InputBatch(BS)
    spec = {"a": (9, 0), "b": (6, 5), "c": (7, 0), "d": (3, 2)}  # prompt tokens, computed
    for rid, (n, c) in spec.items():
        b.add(req(rid, n, computed=c), list(range(10 * len(b), 10 * len(b) + 3)))
    n_sched = np.array([9, 1, 7, 1])  # a, c: whole prompts; b, d: one token each
    b.decodes_first(n_sched)
    assert list(rows(b)) == ["d", "b", "c", "a"] and n_sched.tolist() == [1, 1, 7, 9]
    b.check_integrity()
    assert b.block_table[0, :3].tolist() == [30, 31, 32] and b.num_computed[0] == 2
    inp = b.prepare(n_sched)
    assert inp.input_ids[:2].tolist() == [402, 205]  # d's 3rd and b's 6th prompt token
    assert inp.cu_seqlens_q.tolist() == [0, 1, 2, 9, 18]
    steady = n_sched.copy()
    steady[:] = 1
    before = rows(b)
    b.decodes_first(steady)
    assert rows(b) == before  # nothing to move in a pure decode step


def test_a_steps_sampling_arrays_follow_its_rows_requests():
    """The sampling arrays of a step whose rows hold the previous step's requests are the
    previous step's (nothing recomputed); another request in a row, another order, or a
    request with penalties makes them afresh."""
    from triptych.engine.sample.sampling_params import SamplingParams as SP

    b = InputBatch(BS, max_reqs=4)
    a, c = req("a", 3), req("c", 3)
    a.sampling_params, c.sampling_params = SP(temperature=0), SP(temperature=0.7)
    for r in (a, c):
        b.add(r, [0])
    both = np.array([0, 1])
    first = b.sampling(both, 50)
    assert b.sampling(both, 50) is first and first.random_rows_list == [1]
    assert b.sampling(np.array([1, 0]), 50).random_rows_list == [0]  # another order
    b.remove("c")
    d = req("d", 3)
    d.sampling_params = SP(temperature=0.9, top_k=3)  # another request in that row
    b.add(d, [1])
    got = b.sampling(both, 50)
    assert got is not first and "top_k" in got.names and got.top_k_max == 3
    e = req("e", 3)
    e.sampling_params = SP(temperature=1.0, repetition_penalty=1.3)
    b.add(e, [2])
    three = np.array([0, 1, 2])
    assert b.sampling(three, 50) is not b.sampling(three, 50)  # penalties: every step
