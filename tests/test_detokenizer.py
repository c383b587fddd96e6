"""Incremental detokenization equals a full decode; stop strings cut the text."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from triptych.engine.detokenizer import IncrementalDetokenizer


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
