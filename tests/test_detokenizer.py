"""Incremental detokenization equals a full decode; stop strings cut the text."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from triptych.router.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "héllo wörld ünïcode ✓ 日本語 テキスト"] * 20
    t.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|end|>"]))
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|end|>")


@pytest.mark.parametrize("text", ["the quick brown fox", "héllo 日本語 ✓ テキスト and more",
                                  "  spaces   and\nnewlines\n"])
def test_incremental_equals_full_decode(tok, text):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, tok.encode("prompt"), stop=None)
    deltas = []
    for i in ids:
        d.add_token(i)
        deltas.append(d.pop_delta(finished=False))
    deltas.append(d.pop_delta(finished=True))
    assert d.text == tok.decode(ids) == "".join(deltas)
    assert "\ufffd" not in "".join(deltas)


def test_stop_string_truncates_and_is_held_back(tok):
    ids = tok.encode("the quick brown fox jumps over")
    d = IncrementalDetokenizer(tok, [], stop=["fox"])
    streamed = ""
    hit = None
    for i in ids:
        hit = d.add_token(i)
        if hit:
            break
        streamed += d.pop_delta(finished=False)
    streamed += d.pop_delta(finished=True)
    assert hit == "fox"
    assert d.text == "the quick brown " and streamed == d.text


def test_stop_string_included_when_asked(tok):
    d = IncrementalDetokenizer(tok, [], stop=["brown"], include_stop_str_in_output=True)
    for i in tok.encode("the quick brown fox"):
        if d.add_token(i):
            break
    assert d.text == "the quick brown"


def test_special_tokens_skipped(tok):
    ids = tok.encode("the dog") + [tok.convert_tokens_to_ids("<|end|>")]
    d = IncrementalDetokenizer(tok, [], stop=None)
    for i in ids:
        d.add_token(i)
    assert d.text == "the dog"


def test_bulk_decode_equals_incremental_on_random_ids(tok):
    # Random ids (special tokens, broken UTF-8 byte runs) are what a tiny random model
    # emits: the one-shot decode at the end must give the streamed text exactly.
    import random

    rng = random.Random(0)
    for trial in range(200):
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 6))]
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 25))]
        one = IncrementalDetokenizer(tok, prompt, stop=None)
        for i in ids:
            one.add_token(i)
        bulk = IncrementalDetokenizer(tok, prompt, stop=None)
        bulk.add_tokens(ids)
        assert bulk.text == one.text, (trial, prompt, ids)
        assert bulk.pop_delta(finished=True) == one.pop_delta(finished=True)


def test_outputs_carry_deltas_not_copies_of_the_whole_output(tok):
    """OutputProcessor (router/output_processor.py): each step's output carries the ids it
    adds (and their logprobs as the tail of the list); the whole lists are the completion's
    own, never a copy per step (that was quadratic in the output's length)."""
    from triptych.engine.outputs import EngineCoreOutput
    from triptych.engine.sample.sampling_params import SamplingParams
    from triptych.router.output_processor import OutputProcessor

    text = "héllo 日本語 ✓ the quick brown fox"
    ids = tok.encode(text)
    op = OutputProcessor(tok)
    op.add("r", None, tok.encode("prompt"), SamplingParams(max_tokens=len(ids), logprobs=1))
    seen, lists, deltas = [], set(), []
    for k, t in enumerate(ids):
        (out,), _ = op.process([EngineCoreOutput(
            "r", [t], [{t: -0.5, 0: -3.0}], "length" if k == len(ids) - 1 else None)])
        c = out.outputs[0]
        assert c.token_ids_delta == [t] and [list(d) for d in c.logprobs_delta] == [[t, 0]]
        seen += c.token_ids_delta
        deltas.append(c.text_delta)
        lists.add((id(c.token_ids), id(c.logprobs)))
    assert len(lists) == 1, "a new list per step: the whole output was copied"
    assert c.token_ids == seen == ids and len(c.logprobs) == len(ids)
    assert c.text == "".join(deltas) == text


def test_a_reader_of_deltas_alone_gets_plain_logprobs_kept_until_reported(tok):
    """Registered for deltas only and not streamed (the HTTP server's whole answers): each
    output carries its tokens' logprobs as the worker's plain {id: logprob} dicts, the
    processor keeps none it has reported (no Logprob objects, no history: ``logprobs`` is
    None), and the text comes once, whole, with the finish; ``Router``'s ``_delta`` passes
    those dicts on as they are."""
    from triptych.engine.outputs import EngineCoreOutput
    from triptych.engine.sample.sampling_params import SamplingParams
    from triptych.router.output_processor import OutputProcessor
    from triptych.router.router import _delta

    text = "héllo 日本語 ✓ the quick brown fox"
    ids = tok.encode(text)
    op = OutputProcessor(tok)
    op.add("r", None, tok.encode("prompt"), SamplingParams(max_tokens=len(ids), logprobs=1),
           stream=False, deltas_only=True)
    (child,) = op.parents["r"].children
    texts = []
    for k, t in enumerate(ids):
        sent = {t: -0.5, 0: -3.0}
        (out,), _ = op.process([EngineCoreOutput(
            "r", [t], [sent], "length" if k == len(ids) - 1 else None)])
        c = out.outputs[0]
        assert c.logprobs is None and c.logprobs_delta == [sent]
        assert c.logprobs_delta[0] is sent  # the worker's dict itself, not a copy
        assert _delta(out).completions[0].logprobs == [sent]
        assert child.logprobs == []  # nothing kept once reported
        texts.append(c.text_delta)
    assert texts[:-1] == [""] * (len(ids) - 1) and texts[-1] == text


def test_a_whole_answer_without_logprobs_is_reported_at_its_first_token_and_its_ends(tok):
    """Quiet (router/output_processor.py): not streamed, deltas only, no logprobs, no stop
    strings: an output at the first token and one each time a completion ends, carrying
    every token since the last; nothing in between. The offline view (not deltas only)
    and a streamed request get an output every step."""
    from triptych.engine.outputs import EngineCoreOutput
    from triptych.engine.sample.sampling_params import SamplingParams
    from triptych.router.output_processor import OutputProcessor

    ids = tok.encode("one two three four five six")
    for stream, deltas_only, quiet in ((False, True, True), (False, False, False),
                                       (True, True, False)):
        op = OutputProcessor(tok)
        kids = op.add("r", None, tok.encode("p"), SamplingParams(n=2, max_tokens=len(ids)),
                      stream=stream, deltas_only=deltas_only)
        (c0, _), (c1, _) = kids
        got, tokens = [], {0: [], 1: []}
        for k, t in enumerate(ids):
            outs = [EngineCoreOutput(c0, [t], None, "length" if k == len(ids) - 1 else None)]
            if k <= 2:  # the second completion ends at its third token
                outs.append(EngineCoreOutput(c1, [t], None, "stop" if k == 2 else None))
            reported, _ = op.process(outs)
            got.append(len(reported))
            for out in reported:
                for c in out.outputs:
                    tokens[c.index] += c.token_ids_delta
        if quiet:
            assert got == [1, 0, 1] + [0] * (len(ids) - 4) + [1], got
        else:
            assert got == [1] * len(ids), (stream, deltas_only, got)
        assert tokens == {0: ids, 1: ids[:3]}
