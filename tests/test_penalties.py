"""Penalties, min-p and the no-repeat n-gram guard (engine/sample/penalties.py,
engine/sample/sampler.py).

Units: the batched ops on mixed rows (some penalised, some not) against a per-row
reference written out here, the state's rebuild on (re)join, the free path, min-p against
HF's MinPLogitsWarper on the same logits. Oracle: greedy outputs of a batch mixing every
penalty equal HF transformers' ``generate`` with the equivalent logits processors on the
tiny checkpoint (HF's repetition penalty and no-repeat n-gram processors; presence /
frequency by OpenAI's formula in a small processor below), also across preemption; seeded
min-p sampling only ever emits tokens above its threshold.
"""
from __future__ import annotations

import math

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
)

from triptych import LLM, SamplingParams
from triptych.engine.runner.input_batch import InputBatch
from triptych.engine.sample.penalties import PenaltyState
from triptych.engine.request import Request
from triptych.engine.sample.sampler import Sampler, min_p_filter
from triptych.models.hf_oracle import hf_inputs, load_hf_model, no_eos

SP = SamplingParams


# -- reference (per row, plain Python: what the batched ops must equal) -------------------
def reference(logits: torch.Tensor, sp: SamplingParams, prompt: list[int], out: list[int]
              ) -> torch.Tensor:
    x = logits.clone()
    for t in set(prompt) | set(out):
        if sp.repetition_penalty != 1.0:
            x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    for t in set(out):
        x[t] -= sp.frequency_penalty * out.count(t) + sp.presence_penalty
    n, w = sp.no_repeat_ngram_size, sp.no_repeat_ngram_window
    if n and len(out) >= n:
        start = max(0, len(out) - w) if w else 0
        for i in range(start, len(out) - n + 1):
            if tuple(out[i:i + n - 1]) == tuple(out[len(out) - n + 1:]) and \
                    out[i + n - 1] not in (sp.no_repeat_ngram_whitelist or []):
                x[out[i + n - 1]] = float("-inf")
    return x


ROWS = [  # (params, prompt, outputs)
    (SP(temperature=0, repetition_penalty=1.7), [1, 2, 3], [4, 4, 9]),
    (SP(temperature=0), [1, 2], [3, 3, 3]),  # unpenalised: untouched
    (SP(temperature=0, presence_penalty=0.7, frequency_penalty=-0.4), [5], [2, 2, 6, 2]),
    (SP(temperature=0, no_repeat_ngram_size=2), [0], [1, 2, 3, 1, 5, 1]),
    (SP(temperature=0, no_repeat_ngram_size=2, no_repeat_ngram_whitelist=[5]), [0],
     [1, 2, 3, 1, 5, 1]),
    (SP(temperature=0, no_repeat_ngram_size=3, no_repeat_ngram_window=5), [0],
     [7, 8, 1, 7, 8, 2, 7, 8]),  # (7, 8, 1) lies outside the last 5 tokens
    (SP(temperature=0, no_repeat_ngram_size=1, repetition_penalty=0.5,
        frequency_penalty=1.0), [3, 4], [6, 7]),
    (SP(temperature=1.0, min_p=0.2), [1], [2]),  # min_p alone needs no history
]


def test_batched_ops_equal_the_per_row_reference():
    torch.manual_seed(0)
    logits = torch.randn(len(ROWS), 12) * 3
    state = PenaltyState()
    for i, (sp, prompt, out) in enumerate(ROWS):
        state.add(f"r{i}", sp, prompt, out[:-1])
    rids = [f"r{i}" for i in range(len(ROWS))]
    state.apply(logits, rids)  # a first step; then the last output token arrives
    for i, (_, _, out) in enumerate(ROWS):
        state.append(f"r{i}", out[-1])
    got = state.apply(logits, rids)
    assert sorted(state.entries) == sorted(r for r, (sp, _, _) in zip(rids, ROWS)
                                           if sp.penalised)
    for i, (sp, prompt, out) in enumerate(ROWS):
        want = reference(logits[i], sp, prompt, out)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), i
        fin = ~torch.isinf(want)
        assert torch.allclose(got[i][fin], want[fin], atol=1e-6), (i, got[i], want)
    assert torch.isinf(got[3, 2]) and torch.isinf(got[3, 5]) and not torch.isinf(got[4, 5])
    assert torch.isinf(got[5]).sum() == 1 and torch.isinf(got[5, 2])


def test_state_is_rebuilt_when_a_request_rejoins():
    state = PenaltyState()
    sp = SP(frequency_penalty=1.0)
    logits = torch.zeros(1, 8)
    state.add("a", sp, [0], [1, 1])
    assert state.apply(logits, ["a"])[0, 1] == -2.0
    state.append("a", 1)
    assert state.apply(logits, ["a"])[0, 1] == -3.0
    state.remove("a")  # preempted: its row is gone ...
    assert not state and torch.equal(state.apply(logits, ["a"]), logits)
    state.add("a", sp, [0], [1, 1, 1, 2])  # ... and back with its tokens (recompute)
    got = state.apply(logits, ["a"])
    assert got[0, 1] == -3.0 and got[0, 2] == -1.0 and got[0, 0] == 0.0
    for t in list(range(3, 40)) + [39]:  # new ids past the first buffer (it doubles)
        state.append("a", t)
    got = state.apply(torch.zeros(1, 64), ["a"])
    assert got[0, 3] == -1.0 and got[0, 39] == -2.0 and got[0, 40] == 0.0


def test_the_batch_keeps_the_state_through_join_append_and_row_moves():
    batch = InputBatch(block_size=4)
    reqs = [Request(f"q{i}", [1, 2, 3], SP(temperature=0, presence_penalty=float(i % 2)))
            for i in range(4)]
    for r in reqs:
        batch.add(r, [0])
    assert sorted(batch.penalties.entries) == ["q1", "q3"]  # only those that ask
    batch.remove("q0")
    batch.condense()  # q3 moves to row 0; its state is keyed by id, not row
    batch.append_token(batch.index["q3"], 5)
    e = batch.penalties.entries["q3"]
    assert e.counts[e.where[5]] == 1 and sum(e.counts[:e.n]) == 1
    batch.remove("q3")
    assert list(batch.penalties.entries) == ["q1"]


def test_a_batch_without_penalties_pays_nothing(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the penalty path ran for a batch that asked for none")

    monkeypatch.setattr(PenaltyState, "arrays", boom)
    state = PenaltyState()
    state.add("a", SP(temperature=0, min_p=0.5), [1], [])  # min_p needs no history
    out = Sampler()(torch.tensor([[0.0, 2.0, 1.0]]), ["a"], [SP(temperature=0)], state)
    assert out.token_ids == [1] and not state


@pytest.mark.parametrize("min_p,temp", [(0.05, 1.0), (0.3, 0.7), (0.9, 1.5), (1.0, 1.0)])
def test_min_p_filters_as_hf_min_p_warper(min_p, temp):
    torch.manual_seed(1)
    logits = torch.randn(3, 50) * 2
    params = [SP(temperature=temp, min_p=min_p), SP(temperature=temp),
              SP(temperature=temp, min_p=min_p / 2)]
    temps = torch.tensor([sp.temperature for sp in params])
    got = min_p_filter(logits / temps[:, None], torch.tensor([sp.min_p for sp in params]))
    for row, sp in enumerate(params):
        hf = TemperatureLogitsWarper(temp)(None, logits[row:row + 1].clone())
        if sp.min_p:
            hf = MinPLogitsWarper(sp.min_p)(None, hf)
        assert torch.equal(torch.isinf(got[row]), torch.isinf(hf[0])), row
        fin = ~torch.isinf(hf[0])
        assert torch.allclose(got[row][fin], hf[0][fin], atol=1e-6)
    assert torch.isinf(got[0]).any() and not torch.isinf(got[1]).any()


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3),
                                 dict(repetition_penalty=0), dict(min_p=1.5),
                                 dict(min_p=float("nan")), dict(no_repeat_ngram_size=-1),
                                 dict(extra_args={"ngram_size": 3, "other": 1}),
                                 dict(extra_args={"ngram_size": "3"})])
def test_bad_penalty_params_rejected(bad):
    with pytest.raises(ValueError):
        SP(**bad)


def test_vllm_extra_args_name_the_ngram_guard():
    sp = SP(extra_args={"ngram_size": 30, "window_size": 90, "whitelist_token_ids": {9, 4}})
    assert (sp.no_repeat_ngram_size, sp.no_repeat_ngram_window,
            sp.no_repeat_ngram_whitelist, sp.extra_args) == (30, 90, [4, 9], None)
    assert sp.penalised and not SP(min_p=0.5).penalised


# -- the oracle ---------------------------------------------------------------------------
class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence / frequency penalties over the generated tokens only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor
                 ) -> torch.FloatTensor:
        counts = torch.zeros_like(scores)
        out = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


class OnOutput(LogitsProcessor):
    """An HF processor shown the generated tokens only (our n-gram guard, like vLLM's
    per-request logits processors, looks at the output, not the prompt)."""

    def __init__(self, prompt_len: int, inner: LogitsProcessor) -> None:
        self.prompt_len, self.inner = prompt_len, inner

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor
                 ) -> torch.FloatTensor:
        return self.inner(input_ids[:, self.prompt_len:], scores)


def hf_processors(sp: SamplingParams, prompt_len: int) -> list[LogitsProcessor]:
    out: list[LogitsProcessor] = []
    if sp.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(sp.repetition_penalty))
    if sp.presence_penalty or sp.frequency_penalty:
        out.append(OpenAIPenalties(prompt_len, sp.presence_penalty, sp.frequency_penalty))
    if sp.no_repeat_ngram_size:
        out.append(OnOutput(prompt_len, NoRepeatNGramLogitsProcessor(sp.no_repeat_ngram_size)))
    return out


MAX = 20
CASES = [SP(temperature=0, max_tokens=MAX, ignore_eos=True, **kw) for kw in (
    {}, dict(repetition_penalty=1.5), dict(presence_penalty=1.2, frequency_penalty=0.6),
    dict(presence_penalty=-2.0, frequency_penalty=-0.5),  # (pushes towards loops)
    dict(repetition_penalty=0.5, no_repeat_ngram_size=2),  # loops, broken by the guard
    dict(repetition_penalty=0.3, no_repeat_ngram_size=3),
    dict(min_p=0.5, repetition_penalty=1.2))]  # (min_p leaves greedy alone)
CONVS = [[{"role": "user", "content": t}] for t in
         ("Tell me a story about a cat.", "Say it again and again.")]


@pytest.fixture(scope="module")
def oracle(tiny_qwen2_vl):
    return load_hf_model(tiny_qwen2_vl)


@torch.inference_mode()
def hf_tokens(hf, llm: LLM, conv: list[dict], sp: SamplingParams) -> list[int]:
    prompt = llm.processor.process_chat(conv)
    inp = hf_inputs([prompt], llm.get_tokenizer().pad_token_id or 0)
    no_eos(hf)
    n = len(prompt.prompt_token_ids)
    out = hf.generate(**inp, max_new_tokens=sp.max_tokens, do_sample=False,
                      logits_processor=LogitsProcessorList(hf_processors(sp, n)),
                      pad_token_id=llm.get_tokenizer().pad_token_id or 0)
    return out[0, n:].tolist()


def check_against_hf(llm: LLM, hf, convs: list, params: list) -> list[list[int]]:
    outs = llm.chat(convs, params, use_tqdm=False)  # one batch: penalised rows beside plain
    got = [o.outputs[0].token_ids for o in outs]
    for conv, sp, tokens in zip(convs, params, got):
        assert tokens == hf_tokens(hf, llm, conv, sp), sp
    return got


def test_greedy_with_penalties_equals_hf(tiny_qwen2_vl, oracle):
    llm = LLM(tiny_qwen2_vl, block_size=4, kv_cache_memory="64MiB")
    convs = [c for c in CONVS for _ in CASES]
    got = check_against_hf(llm, oracle, convs, CASES * len(CONVS))
    for k in range(len(CONVS)):
        plain, *penalised = got[k * len(CASES):(k + 1) * len(CASES)]
        changed = [t != plain for t in penalised]
        assert sum(changed) >= len(penalised) - 1, "the penalties must change the outputs"
        for sp, t in zip(CASES, got[k * len(CASES):]):  # the guard held
            n = sp.no_repeat_ngram_size
            grams = [tuple(t[i:i + n]) for i in range(len(t) - n + 1)] if n else []
            assert len(grams) == len(set(grams))


def test_penalties_survive_preemption(tiny_qwen2_vl, oracle):
    # Prompts of ~45 tokens (12 blocks) + 20 outputs: two fit in 30 blocks, then both grow
    # and one is preempted; its penalty state is rebuilt from its tokens when it returns.
    llm = LLM(tiny_qwen2_vl, block_size=4, num_kv_blocks=30, max_num_seqs=4,
              enable_prefix_caching=False)
    convs = [[{"role": "user", "content": f"Story {i}: tell me about a cat."}] for i in range(4)]
    params = [CASES[1], CASES[2], CASES[4], CASES[5]]
    check_against_hf(llm, oracle, convs, params)
    assert llm.engine.scheduler.num_preemptions_total > 0


def test_seeded_min_p_sampling_stays_above_the_threshold(tiny_qwen2_vl):
    llm = LLM(tiny_qwen2_vl, block_size=4, kv_cache_memory="64MiB")
    conv = CONVS[0]
    min_p = 0.4
    for seed in range(3):
        sp = SP(temperature=1.0, min_p=min_p, seed=seed, max_tokens=12, ignore_eos=True,
                logprobs=1)
        (out,) = llm.chat(conv, sp, use_tqdm=False)
        c = out.outputs[0]
        for tok, d in zip(c.token_ids, c.logprobs):
            top = max(lp.logprob for lp in d.values())  # (raw logprobs: temperature 1)
            assert d[tok].logprob >= math.log(min_p) + top - 1e-4
        (again,) = llm.chat(conv, sp, use_tqdm=False)
        assert again.outputs[0].token_ids == c.token_ids  # seeded: reproducible


def test_ngram_guard_index_equals_a_scan_of_the_window():
    """The guard's index (updated token by token, engine/sample/ngram_guard.py) bans exactly
    what a scan of the window bans, for every n, window and whitelist, at every length:
    its step cost no longer grows with the window or n, its answers must not change."""
    import random

    from triptych.engine.sample.ngram_guard import NgramGuard

    rng = random.Random(0)
    for _ in range(300):
        n, w = rng.randint(1, 5), rng.choice([0, 0, rng.randint(1, 12)])
        wl = rng.sample(range(6), rng.randint(0, 2))
        out = [rng.randrange(6) for _ in range(rng.randint(0, 40))]
        guard = NgramGuard(n, w, wl, out[:3])
        for k in range(3, len(out) + 1):
            if k > 3:
                guard.append(out[k - 1])
            seen = out[:k]
            want = set()
            if len(seen) >= n and not (w and w < n):
                start = max(0, len(seen) - w) if w else 0
                for i in range(start, len(seen) - n + 1):
                    if seen[i:i + n - 1] == seen[len(seen) - n + 1:] and \
                            seen[i + n - 1] not in wl:
                        want.add(seen[i + n - 1])
            assert set(guard.banned(vocab=5)) == {t for t in want if t < 5}, (n, w, wl, seen)
