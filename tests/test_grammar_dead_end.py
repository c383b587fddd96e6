"""A request whose grammar allows no next token (issue 36, row 4's engine half) ends alone
with finish_reason "error", instead of an all -inf row failing the step (NaN
probabilities) and the batch being bisected around it. ``root ::= "a" b; b ::= b`` lets
its first token be "a" (so P0's check passes it) and nothing after."""
from __future__ import annotations

import pytest
from triptych import LLM, SamplingParams
from triptych.engine.structured.structured_params import StructuredOutputsParams

NO_WAY_ON = 'root ::= "a" b\nb ::= b'


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl):
    return LLM(tiny_qwen2_vl, block_size=4, max_model_len=512)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_with_no_way_on_ends_its_request_alone(llm, temperature):
    core = llm.engine.core
    failed_steps = core.num_failed_steps
    dead = SamplingParams(max_tokens=8, temperature=temperature, seed=3,
                          structured_outputs=StructuredOutputsParams(grammar=NO_WAY_ON))
    fine = SamplingParams(max_tokens=8, temperature=temperature, seed=5, ignore_eos=True)
    outs = llm.generate(["Go:", "Go:", "Stop:"], [fine, dead, fine], use_tqdm=False)
    ended = outs[1]
    assert ended.outputs[0].finish_reason == "error", ended
    assert ended.outputs[0].text == "a"  # what the grammar allowed, nothing sampled past it
    assert "allows no further token" in (ended.error or "")
    for o in (outs[0], outs[2]):
        assert o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 8
    assert core.num_failed_steps == failed_steps, "the step failed and was bisected"
    assert not core.runner.batch.grammars.dead
    # the engine goes on: the same batch shape again, all fine
    again = llm.generate(["Go:"] * 2, fine, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in again] == [8, 8]
