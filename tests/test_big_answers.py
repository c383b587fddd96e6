"""Big answers cost P0 nothing it cannot afford (issue 42, row 5): a whole response's
logprobs are rendered delta by delta as they arrive and joined at the end
(api/openai_format.py ``Formatter.add`` / ``whole``). The JSON must be exactly what the
whole-at-once rendering gave, for chat and completions, with echo and several choices."""
from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer
from triptych.api.openai_format import Choice, Formatter, PromptInfo, Shape
from triptych.worker import wire


@pytest.fixture(scope="module")
def tok(tiny_qwen2_vl):
    return AutoTokenizer.from_pretrained(tiny_qwen2_vl)


def deltas(rng: random.Random, n_tokens: int, k: int) -> list[wire.CompletionDelta]:
    out, left = [], n_tokens
    while left:
        m = min(left, rng.randint(1, 4))
        ids = [rng.randrange(600) for _ in range(m)]
        lps = [{t: -rng.random() for t in [i] + [rng.randrange(600) for _ in range(k)]}
               for i in ids]
        left -= m
        out.append(wire.CompletionDelta(0, "".join(f"<{t}>" for t in ids), ids,
                                        "length" if not left else None, logprobs=lps))
    return out


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("echo", ["", "Once upon"])
def test_logprobs_rendered_as_they_arrive_equal_the_whole_rendering(tok, chat, echo):
    rng, n, k = random.Random(0), 3, 5
    fmt = Formatter(tok, Shape(chat, "tiny", n=n, logprobs=k), "id", 0)
    prompt = PromptInfo([1, 2, 3], echo=echo,
                        prompt_logprobs=[None, {2: -0.5, 7: -1.0}, {3: -0.25, 9: -2.0}])
    choices = [Choice() for _ in range(n)]
    streams = [deltas(rng, rng.randint(0, 40), k) for _ in range(n)]
    for i, stream in enumerate(streams):
        for d in stream:
            fmt.add(choices[i], wire.CompletionDelta(i, d.text, d.token_ids, d.finish_reason,
                                                     logprobs=d.logprobs), prompt)
    got = json.loads(fmt.whole([prompt], choices))
    for i, stream in enumerate(streams):  # the reference: all tokens rendered at once
        ids = [t for d in stream for t in d.token_ids]
        lps = [x for d in stream for x in d.logprobs]
        if chat:
            want = fmt.chat_logprobs(ids, lps)
        else:
            want = fmt.completion_logprobs(ids, lps, len(echo))
            if echo:
                head = fmt.echo_logprobs(prompt)
                want = {key: head[key] + want[key] for key in head}
        assert got["choices"][i]["logprobs"] == json.loads(json.dumps(want)), i
        text = echo + "".join(d.text for d in stream)
        assert (got["choices"][i]["message"]["content"] if chat else
                got["choices"][i]["text"]) == text
    assert got["usage"]["completion_tokens"] == sum(len(d.token_ids) for s in streams for d in s)


def test_a_choice_whose_text_holds_the_splice_mark_is_left_alone(tok):
    """The logprobs go where a per-response random mark stands: a completion's own text
    cannot aim the splice."""
    fmt = Formatter(tok, Shape(True, "tiny", n=1, logprobs=0), "id", 0)
    c = Choice()
    fmt.add(c, wire.CompletionDelta(0, "\u0000x:0\u0000", [5], "stop", logprobs=[{5: -0.1}]),
            PromptInfo([1]))
    body = json.loads(fmt.whole([PromptInfo([1])], [c]))
    assert body["choices"][0]["message"]["content"] == "\u0000x:0\u0000"
    assert body["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.1


def test_a_big_answer_is_served_in_pieces_never_joined(tok):
    """n=4 x 1,500 tokens x 20 alternatives (~8 MB of JSON): the response comes as pieces
    none of which holds more than a few hundred tokens' logprobs; together they are the
    very JSON of ``whole``."""
    rng, n, k = random.Random(1), 4, 20
    fmt = Formatter(tok, Shape(True, "tiny", n=n, logprobs=k), "id", 0)
    prompt = PromptInfo([1, 2, 3])
    choices = [Choice() for _ in range(n)]
    for i in range(n):
        for d in deltas(rng, 1500, k):
            fmt.add(choices[i], wire.CompletionDelta(i, d.text, d.token_ids, d.finish_reason,
                                                     logprobs=d.logprobs), prompt)
    pieces = list(fmt.whole_pieces([prompt], choices))
    total = sum(map(len, pieces))
    assert total > 5_000_000 and max(map(len, pieces)) < total // 20
    body = json.loads("".join(pieces))
    assert "".join(pieces) == fmt.whole([prompt], choices)
    assert [len(c["logprobs"]["content"]) for c in body["choices"]] == [1500] * n
    assert all(1 <= len(t["top_logprobs"]) <= k for c in body["choices"]
               for t in c["logprobs"]["content"])  # (k drawn alternatives may repeat)


@pytest.mark.parametrize("as_ids", [False, True])
def test_chat_logprobs_written_as_text_equal_json_of_the_dicts_byte_for_byte(tok, as_ids):
    """api/logprobs_json.py writes each alternative from pieces kept per token id; its text
    is json.dumps's of the dicts, byte for byte (ids across the vocabulary: multi-byte
    characters, partial UTF-8, quotes and backslashes), and a non-finite logprob is refused
    as json refuses it."""
    from triptych.api.logprobs_json import ItemPieces
    from triptych.api.openai_format import _dumps

    rng = random.Random(1)
    vocab = len(tok)
    for k in (0, 1, 5):
        fmt = Formatter(tok, Shape(True, "tiny", logprobs=k, tokens_as_ids=as_ids), "id", 0)
        ids = [rng.randrange(vocab) for _ in range(60)]
        lps = [{t: rng.choice([-rng.random() * 30, 0.0, -1e-7, -123456.789])
                for t in [i] + [rng.randrange(vocab) for _ in range(k)]} for i in ids]
        pieces = ItemPieces(tok, as_ids, fmt._token)
        assert pieces.content(ids, lps, k) == _dumps(fmt.chat_logprobs(ids, lps)["content"])[1:-1]
    with pytest.raises(ValueError):
        pieces.content([5], [{5: float("-inf")}], 0)
    with pytest.raises(ValueError):
        _dumps(fmt.chat_logprobs([5], [{5: float("-inf")}]))
