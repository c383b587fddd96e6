"""A structured-output request whose grammar work outgrows its share of the step is ended
alone (issue 42, row 2): an ambiguous EBNF grammar compiles at once, then its matcher costs
more per token as the output grows (~300 ms a token by token 170 here), inside the batch
step every request waits for. The budget (engine/structured/grammar_budget.py) ends it with an error
naming --max-grammar-step-ms; its batch-mates run to the end; an operator's larger
allowance lets the same request run."""
from __future__ import annotations

import pytest
from triptych import LLM, SamplingParams
from triptych.engine.structured.grammar_budget import STRIKES, GrammarBudget
from triptych.engine.structured.structured_params import StructuredOutputsParams

AMBIGUOUS = 'root ::= s\ns ::= s s s | s s | "a" | ""'


def ambiguous(max_tokens: int, a_token: int) -> SamplingParams:
    # the bias makes "a" the greedy pick among what the grammar allows (EOS included), so
    # the output is "a"s, as long as max_tokens, whatever the random model prefers
    return SamplingParams(max_tokens=max_tokens, temperature=0, logit_bias={a_token: 100.0},
                          structured_outputs=StructuredOutputsParams(grammar=AMBIGUOUS))


def a_token(llm: LLM) -> int:
    (tid,) = llm.get_tokenizer().encode("a", add_special_tokens=False)
    return tid


@pytest.fixture(scope="module")
def tiny(tiny_qwen2_vl):
    return tiny_qwen2_vl


def test_an_ambiguous_grammar_is_ended_and_its_batch_mates_finish(tiny):
    llm = LLM(tiny, block_size=4, max_model_len=512)
    try:
        fine = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        outs = llm.generate(["Go:", "Count:", "Go on:"], [fine, ambiguous(400, a_token(llm)), fine],
                            use_tqdm=False)
        ended = outs[1].outputs[0]
        assert ended.finish_reason == "error", ended
        assert "--max-grammar-step-ms" in (outs[1].error or ""), outs[1].error
        assert 0 < len(ended.token_ids) < 400 and set(ended.text) <= {"a"}
        for o in (outs[0], outs[2]):  # batch-mates: every token, undisturbed
            assert o.outputs[0].finish_reason == "length"
            assert len(o.outputs[0].token_ids) == 200
        assert not llm.engine.core.runner.batch.grammars.budget.strikes
    finally:
        llm.close()


def test_an_operator_allowance_lets_the_same_grammar_run(tiny):
    llm = LLM(tiny, block_size=4, max_model_len=512, max_grammar_step_ms=60_000)
    try:
        out = llm.generate(["Count:"], ambiguous(40, a_token(llm)), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "length" and out.text == "a" * len(out.token_ids)
        assert len(out.token_ids) == 40
    finally:
        llm.close()


def test_the_budget_strikes_only_steps_running_over_it():
    budget = GrammarBudget(fixed_s=0.010)
    over, under = {"r": 0.02}, {"r": 0.001}
    for _ in range(STRIKES - 1):
        assert budget.judge(over) == {}
    assert budget.judge(under) == {}  # one fast step clears the strikes
    for _ in range(STRIKES - 1):
        assert budget.judge(over) == {}
    assert budget.judge(over) == {"r": 0.02}
    assert "--max-grammar-step-ms 10" in budget.message(0.02)
    auto = GrammarBudget()
    assert auto.allowance_s == pytest.approx(0.25e-3)  # the floor, before any step is seen
    auto.step_s = 0.010
    assert auto.allowance_s == pytest.approx(0.005)  # then half the step's own time
