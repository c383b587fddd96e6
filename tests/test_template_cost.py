"""The chat template's own size, measured once (api/template_cost.py), bounds a
conversation before it is rendered (issue 42, row 6). The bound must never exceed what
rendering really gives, or a request the model could serve would be refused: checked on
random conversations against the real templates of the tiny checkpoints and the demo's."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer
from triptych.api.template_cost import TemplateCost


@pytest.fixture(scope="module", params=["qwen2_vl", "internvl", "demo"])
def tokenizer(request, tiny_qwen2_vl, tmp_path_factory):
    if request.param == "demo":
        from triptych.models.demo import demo_checkpoint
        return AutoTokenizer.from_pretrained(demo_checkpoint())
    if request.param == "internvl":
        from triptych.models.tiny import make_tiny
        path = make_tiny("internvl", str(tmp_path_factory.mktemp("tiny") / "internvl"), seed=0)
        return AutoTokenizer.from_pretrained(path)
    return AutoTokenizer.from_pretrained(tiny_qwen2_vl)


def test_the_bound_never_exceeds_the_rendering(tokenizer):
    cost = TemplateCost.of_tokenizer(tokenizer)
    assert cost.of("user").tokens >= 1 and cost.of("user").chars > 0  # it measured something
    specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    rng = random.Random(0)
    for _ in range(60):
        roles = ["user"] if rng.random() < 0.5 else ["system", "user"]
        for _ in range(rng.randint(0, 8)):
            roles.append(rng.choice(["assistant", "user"]) if roles[-1] != "user"
                         else "assistant")
        msgs = [{"role": r, "content": "".join(rng.choice("ab c") for _ in range(
            rng.randint(0, 12)))} for r in roles]
        try:
            text = tokenizer.apply_chat_template(msgs, tokenize=False)
        except Exception:  # noqa: BLE001 - a conversation the template refuses
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        bound = cost.bound(roles)
        content = sum(len(m["content"]) for m in msgs)
        n_special = sum(tokenizer.convert_ids_to_tokens(i) in specials for i in ids)
        assert bound.tokens <= n_special <= len(ids), (roles, bound)
        assert bound.chars <= max(0, len(text) - content) + content, (roles, bound)


def test_many_empty_messages_are_bounded_without_rendering(tiny_qwen2_vl):
    cost = TemplateCost.of_tokenizer(AutoTokenizer.from_pretrained(tiny_qwen2_vl))
    bound = cost.bound(["user"] * 250_000)
    assert bound.tokens >= 2 * 249_999  # <|im_start|> and <|im_end|> per message
    assert bound.chars >= 20 * 249_999


def test_no_template_or_a_refusing_one_bounds_nothing():
    assert TemplateCost().bound(["user"] * 10).tokens == 0

    def refuse(msgs: list[dict]) -> str:
        raise ValueError("no")

    assert TemplateCost.measure(refuse, lambda s: 0).bound(["user"] * 10).chars == 0


def test_the_raw_body_bound_refuses_only_what_the_parsed_check_refuses(tokenizer):
    """``raw_bound`` (run on a chat body before it is parsed) counts the messages' role
    pairs: never more than the validation pass counts once parsed, so it refuses nothing
    that pass would take; a "role" inside a text or a tool schema's property is no message."""
    import json

    cost = TemplateCost.of_tokenizer(tokenizer)
    least = cost.least_per_message()
    limit = 1000
    for n in range(1, 3 * limit // least):
        msgs = [{"role": "user" if k % 2 == 0 else "assistant", "content": ""}
                for k in range(n)]
        parsed = n + cost.bound(m["role"] for m in msgs).chars  # what check_chat counts
        raw = cost.raw_bound(json.dumps({"messages": msgs}).encode(), limit)
        assert raw is None or parsed > limit, n
        if raw is not None:
            assert f"({n} messages)" in raw and "--max-prompt-chars" in raw
    refused = [{"role": "user", "content": ""}] * (2 * limit)
    assert cost.raw_bound(json.dumps({"messages": refused}).encode(), limit) is not None
    decoys = {"messages": [{"role": "user", "content": '"role": "user" ' * 5000}],
              "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                  "type": "object", "properties": {"role": {"type": "string"}}}}}] * 3000}
    assert cost.raw_bound(json.dumps(decoys).encode(), limit) is None
