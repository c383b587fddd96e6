"""Sampler: greedy, seeded reproducibility, top-k / top-p honoured, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from triptych.engine.sample.sampler import Sampler
from triptych.engine.sample.sampling_params import SamplingParams


def test_greedy_and_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    out = Sampler()(logits, ["a", "b"], [SamplingParams(temperature=0, logprobs=2),
                                         SamplingParams(temperature=0)])
    assert out.token_ids == [1, 0]
    lp = torch.log_softmax(logits[0], -1)
    assert set(out.logprobs[0]) == {1, 3}
    assert math.isclose(out.logprobs[0][1], float(lp[1]), rel_tol=1e-6)
    assert out.logprobs[1] is None


def test_seeded_sampling_reproducible_and_independent_of_batch():
    logits = torch.randn(1, 50)
    sp = SamplingParams(temperature=1.0, seed=1234)
    a = [Sampler(seed=0)(logits, ["x"], [sp]).token_ids[0] for _ in range(1)]
    s = Sampler(seed=99)
    # Same request seed, different neighbours and default seed: same draws.
    other = SamplingParams(temperature=1.0)
    seq1 = [s(torch.cat([logits, torch.randn(1, 50)]), ["x", "y"], [sp, other]).token_ids[0]
            for _ in range(5)]
    s2 = Sampler(seed=7)
    seq2 = [s2(logits, ["x"], [sp]).token_ids[0] for _ in range(5)]
    assert seq1 == seq2 and seq1[0] == a[0]


def test_top_k_only_draws_top_tokens():
    logits = torch.tensor([[1.0, 4.0, 3.0, 0.5, 2.0]])
    s = Sampler(seed=0)
    draws = {s(logits, ["r"], [SamplingParams(temperature=5.0, top_k=2)]).token_ids[0]
             for _ in range(200)}
    assert draws == {1, 2}


def test_top_p_only_draws_nucleus():
    # probs ~ [0.6, 0.3, 0.05, 0.05]: top_p=0.8 keeps tokens 0 and 1 only.
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    s = Sampler(seed=0)
    draws = {s(logits, ["r"], [SamplingParams(temperature=1.0, top_p=0.8)]).token_ids[0]
             for _ in range(300)}
    assert draws == {0, 1}


def test_temperature_spreads_draws():
    logits = torch.tensor([[2.0, 1.9, 1.8]])
    s = Sampler(seed=0)
    draws = {s(logits, ["r"], [SamplingParams(temperature=1.0)]).token_ids[0] for _ in range(100)}
    assert draws == {0, 1, 2}


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-5),
                                 dict(max_tokens=0), dict(n=0), dict(logprobs=50)])
def test_bad_params_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_draws_follow_the_distribution():
    """2,000 rows of one distribution in one call (the inverse-CDF draw, one uniform a
    row): the counts fit the probabilities (chi-square, 3 degrees of freedom, p = 0.001
    bound), and a token of probability ~1e-12 next to big ones is not lost or favoured."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(p).repeat(2000, 1)
    sps = [SamplingParams(temperature=1.0)] * 2000
    ids = Sampler(seed=3)(logits, [f"r{i}" for i in range(2000)], sps).token_ids
    counts = torch.bincount(torch.tensor(ids), minlength=4).double()
    expected = 2000 * p.double()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (counts.tolist(), chi2)
    tiny = torch.tensor([[0.0, -27.6, 0.0]])  # e^-27.6 ~ 1e-12 of the mass
    s = Sampler(seed=0)
    draws = [s(tiny, ["t"], [SamplingParams(temperature=1.0)]).token_ids[0]
             for _ in range(400)]
    assert set(draws) == {0, 2} and 150 < draws.count(0) < 250
