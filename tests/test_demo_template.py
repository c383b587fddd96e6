"""The demo checkpoint states its single task whatever the user writes (demo/template.py):
its chat template turns every user turn into its images then the one instruction training
used most, drops system turns, keeps assistant turns; for an image and that instruction it
renders what training rendered; the shipped checkpoint carries it for the tokenizer (the
engine) and for HF's processor (the oracle) alike."""
from __future__ import annotations

import json
import os

import pytest
from transformers import AutoTokenizer
from triptych.demo import template
from triptych.demo.batches import Batcher
from triptych.models.demo import demo_checkpoint

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ASK = f"<|im_start|>user\n{IMAGE}{template.INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(demo_checkpoint(), local_files_only=True)


def render(tok, messages: list[dict], **kw) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Transcribe."}]}],
    [{"role": "user", "content": [{"type": "text", "text": "Text first:"}, {"type": "image"}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "system", "content": "You are an OCR engine."},
     {"role": "user", "content": [{"type": "image"},
                                  {"type": "text", "text": "Please type out every word, "
                                   "keeping the punctuation and capital letters."}]}],
    [{"role": "developer", "content": "Be brief."},
     {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}],
])
def test_every_prompt_becomes_the_one_instruction(tok, messages: list[dict]) -> None:
    assert render(tok, messages) == ASK


def test_turns_keep_their_images_and_the_answers(tok) -> None:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}]},
                {"role": "assistant", "content": "Invoice 2041"},
                {"role": "user", "content": [{"type": "image"}, {"type": "image"}]}]
    assert render(tok, messages) == (
        f"<|im_start|>user\n{IMAGE}{template.INSTRUCTION}<|im_end|>\n"
        "<|im_start|>assistant\nInvoice 2041<|im_end|>\n"
        f"<|im_start|>user\n{IMAGE}{IMAGE}{template.INSTRUCTION}<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert render(tok, [{"role": "user", "content": "hello"}]) == \
        f"<|im_start|>user\n{template.INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"


def test_serving_renders_what_training_rendered_for_the_instruction(tok) -> None:
    batcher = Batcher(demo_checkpoint())  # training's template (template.TRAIN)
    msgs = [{"role": "user", "content": [{"type": "image"},
                                         {"type": "text", "text": template.INSTRUCTION}]}]
    trained = batcher.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert trained == render(tok, msgs) == ASK
    # One token for the whole instruction (an added token), as in training.
    assert tok.encode(template.INSTRUCTION, add_special_tokens=False) == \
        [tok.convert_tokens_to_ids(template.INSTRUCTION)]


def test_the_checkpoint_carries_the_serving_template_for_both_loaders() -> None:
    ckpt = demo_checkpoint()
    with open(os.path.join(ckpt, "chat_template.jinja")) as f:
        assert f.read() == template.SERVE
    with open(os.path.join(ckpt, "chat_template.json")) as f:
        assert json.load(f)["chat_template"] == template.SERVE


def test_template_text_never_reaches_an_answer(tok) -> None:
    """The prompt phrases and role names are special tokens: an answer's text drops them as
    it drops <|im_start|> (every decode skips special tokens unless asked not to), and
    training spells them out letter by letter when a transcription holds one, so reading
    a line that ends in "user" still says so."""
    from triptych.demo.batches import PHRASES

    ids = [tok.convert_tokens_to_ids(p) for p in PHRASES]
    assert all(tok.added_tokens_decoder[i].special for i in ids)
    leaked = tok.decode([ids[5], ids[5], *tok.encode("ok", add_special_tokens=False)],
                        skip_special_tokens=True)
    assert leaked == "ok"  # was "user\nuser\nok"
    labels = Batcher(demo_checkpoint()).label_ids("the user\nsystem")
    assert not set(labels) & set(ids)
    assert tok.decode(labels, skip_special_tokens=True) == "the user\nsystem"
