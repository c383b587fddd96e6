"""Structured output on a random tiny checkpoint (which otherwise emits junk), against one
1e1p2d `triptych serve` (prefill applies the grammar to the first token, decode replays it
into a fresh matcher; processor and prefix caches on, as by default) and offline: every
JSON output parses and validates against its schema, every regex output fully matches,
every choice is one of the choices; with n=3, with images, across a decode-worker kill;
invalid constraints are 400s naming the reason."""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from triptych import LLM, SamplingParams
from triptych.engine.structured.structured_params import StructuredOutputsParams

sys.path.insert(0, os.path.dirname(__file__))
import openai
from server_fixtures import data_url, image_part, img, module_server, png, text_part, user

ENUM = {"enum": ["red", "green", "blue"]}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 9}
SHORT = {"type": "string", "maxLength": 4}


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS = [  # 20 schemas with small bounded outputs
    {"type": "boolean"}, SMALL_INT, ENUM, SHORT, {"type": "null"}, {"const": "fixed"},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "string", "pattern": "^[a-z]{1,4}$"},
    {"anyOf": [SMALL_INT, {"type": "boolean"}]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    obj({"ok": {"type": "boolean"}}),
    obj({"n": {"type": "integer", "minimum": 0, "maximum": 99}, "flag": {"type": "boolean"}}),
    obj({"color": ENUM, "size": {"enum": ["S", "M", "L"]}}),
    obj({"inner": obj({"x": {"type": "boolean"}})}),
    obj({"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"tags": {"type": "array", "items": ENUM, "maxItems": 2}}),
    obj({"a": {"type": "boolean"}, "b": {"type": "null"}}, required=[]),
    obj({"status": {"const": "ok"}, "code": {"type": "integer", "minimum": 100,
                                             "maximum": 599}}),
    {"oneOf": [{"const": "yes"}, {"const": "no"}]},
]
REGEXES = [r"[a-z]{3}", r"\d{2}-\d{2}", r"(yes|no)", r"[A-F0-9]{4}", r"ab{1,3}c?"]
CHOICES = ["alpha", "beta", 'say "hi"']
HI = [{"role": "user", "content": "Answer."}]


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, tmp_path_factory):
    yield from module_server(tiny_qwen2_vl, tmp_path_factory,
                             "--block-size", "4", "--max-model-len", "1024",
                             "--encode-workers", "1", "--prefill-workers", "1",
                             "--decode-workers", "2", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(timeout=180)


def constraint(i: int, schema: dict) -> dict:
    """The request fields for ``schema``, in each spelling clients use (by turns)."""
    return [{"response_format": {"type": "json_schema", "json_schema": {
                "name": f"s{i}", "schema": schema, "strict": True}}},
            {"structured_outputs": {"json": schema}},
            {"guided_json": schema},
            {"structured_outputs": {"json": json.dumps(schema),
                                    "disable_any_whitespace": True}}][i % 4]


def chat(client, body: dict, messages=HI, **kw):
    rf = body.get("response_format")
    extra = {k: v for k, v in body.items() if k != "response_format"}
    return client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=kw.pop("max_tokens", 160),
        temperature=kw.pop("temperature", 1.0), seed=kw.pop("seed", 0),
        **({"response_format": rf} if rf else {}), extra_body=extra, **kw)


def check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_json_schemas_validate_in_every_spelling(client):
    def one(i: int):
        return chat(client, constraint(i, SCHEMAS[i]), seed=i,
                    temperature=0 if i % 5 == 0 else 1.0)

    with ThreadPoolExecutor(8) as ex:  # batched together, beside unconstrained requests
        junk = [ex.submit(chat, client, {}, seed=i, max_tokens=24) for i in range(3)]
        outs = list(ex.map(one, range(len(SCHEMAS))))
    for i, (schema, out) in enumerate(zip(SCHEMAS, outs)):
        c = out.choices[0]
        assert c.finish_reason == "stop", (i, c.message.content)
        check_json(c.message.content, schema)
    assert all(j.result().choices[0].finish_reason == "length" for j in junk)


def test_regex_and_choice_outputs_match(client):
    for i, rx in enumerate(REGEXES):
        body = {"structured_outputs": {"regex": rx}} if i % 2 else {"guided_regex": rx}
        out = client.completions.create(model="tiny", prompt="Code:", max_tokens=32, seed=i,
                                        extra_body=body)
        assert re.fullmatch(rx, out.choices[0].text), (rx, out.choices[0].text)
        assert out.choices[0].finish_reason == "stop"
    for body in ({"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}}):
        out = chat(client, body, n=3)
        assert [c.message.content in CHOICES for c in out.choices] == [True] * 3


def test_n3_json_object_grammar_and_images(server, client):
    schema = SCHEMAS[13]
    out = chat(client, {"structured_outputs": {"json": schema}}, n=3, seed=7)
    assert len(out.choices) == 3
    for c in out.choices:
        check_json(c.message.content, schema)
    # Any object: its keys and strings are unbounded, so a junk model may run to the cap.
    out = chat(client, {"response_format": {"type": "json_object"}}, n=2, seed=3)
    for c in out.choices:
        assert c.message.content.lstrip().startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
    ebnf = 'root ::= "<" ("x" | "y")+ ">"'
    out = chat(client, {"guided_grammar": ebnf}, max_tokens=40)
    assert re.fullmatch(r"<[xy]+>", out.choices[0].message.content) or \
        out.choices[0].finish_reason == "length"
    # The same image twice: the second request hits the processor and prefix caches.
    msgs = user(image_part(data_url(png(img(5)))), text_part("Describe it as JSON."))
    hits = [server.metric(f"triptych:{c}_hits_total") for c in ("prefix_cache",
                                                                 "mm_processor_cache")]
    for seed in (1, 1):
        out = chat(client, {"structured_outputs": {"json": SCHEMAS[15]}}, messages=msgs,
                   seed=seed)
        check_json(out.choices[0].message.content, SCHEMAS[15])
    # NOTE: workers report their counters every 0.25 s: wait for the hits to arrive (a
    # hang guard, not a speed bound).
    deadline = time.monotonic() + 60
    while True:
        grew = [server.metric(f"triptych:{c}_hits_total") > h for c, h in zip(
            ("prefix_cache", "mm_processor_cache"), hits)]
        if grew == [True, True] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert grew == [True, True]
    # Stop strings and max_tokens still apply: a cut-off is finish_reason length.
    out = chat(client, {"guided_json": SCHEMAS[14]}, max_tokens=3)
    assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body,param,words", [
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs", "json"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one output constraint"),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ({"structured_outputs": {"structural_tag": '{"format": 3}'}}, "structured_outputs",
     "Format must be an object"),
])
def test_invalid_constraints_are_400s_naming_the_reason(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, body)
    err = e.value.body
    assert err["param"] == param and words in err["message"], err


def test_a_decode_worker_kill_mid_stream_keeps_the_grammar(server, client):
    """The stream moves to the other decode worker, which replays the streamed tokens into
    a fresh matcher: the whole output still validates."""
    schema = {"type": "array", "minItems": 40, "maxItems": 40,
              "items": {"type": "string", "pattern": "^[a-z]{6}$"}}
    got = {"text": "", "chunks": 0, "finish": None, "error": None}

    def run() -> None:
        try:
            for c in chat(client, {"structured_outputs": {"json": schema,
                                                          "disable_any_whitespace": True}},
                          stream=True, temperature=0, max_tokens=900):
                if c.choices and c.choices[0].delta.content:
                    got["text"] += c.choices[0].delta.content
                    got["chunks"] += 1
                if c.choices and c.choices[0].finish_reason:
                    got["finish"] = c.choices[0].finish_reason
        except Exception as e:  # noqa: BLE001 (the test looks at what the client saw)
            got["error"] = e

    before = server.metric("triptych:request_migrations_total")
    t = threading.Thread(target=run)
    t.start()
    victim, deadline = None, time.time() + 120
    while victim is None and time.time() < deadline and t.is_alive():
        for w in httpx.get(server.base + "/health", timeout=5).json()["pools"]["decode"][
                "workers"]:
            if w["requests"] and w["state"] == "up" and got["chunks"] >= 5:
                victim = w
        time.sleep(0.005)
    assert victim is not None, "the stream ended before a decode worker could be killed"
    os.kill(victim["pid"], signal.SIGKILL)
    t.join(180)
    assert got["error"] is None and got["finish"] == "stop", got
    check_json(got["text"], schema)
    assert server.metric("triptych:request_migrations_total") > before


def test_offline_generate_with_structured_outputs(tiny_qwen2_vl):
    llm = LLM(tiny_qwen2_vl, block_size=4, max_model_len=512)
    S = StructuredOutputsParams
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<a>"},
        {"type": "json_schema", "json_schema": {"type": "boolean"}}]}}
    specs = [S(json=SCHEMAS[12]), S(regex=REGEXES[1]), S(choice=CHOICES), S(json_object=True),
             S(structural_tag=json.dumps(tag))]
    params = [SamplingParams(max_tokens=160, seed=i, structured_outputs=s)
              for i, s in enumerate(specs)] + [SamplingParams(max_tokens=8, seed=9)]
    outs = [o.outputs[0] for o in llm.generate(["Go:"] * 6, params, use_tqdm=False)]
    check_json(outs[0].text, SCHEMAS[12])
    assert re.fullmatch(REGEXES[1], outs[1].text) and outs[2].text in CHOICES
    assert isinstance(json.loads(outs[3].text), dict)
    assert re.fullmatch(r"<a>\s*(true|false)\s*", outs[4].text), outs[4].text
    assert all(o.finish_reason == "stop" for o in outs[:5]), outs
    grammars = llm.engine.core.runner.batch.grammars
    masked = grammars.num_masked_steps
    llm.generate(["Plain:"] * 2, SamplingParams(max_tokens=8), use_tqdm=False)
    assert grammars.num_masked_steps == masked, "a batch without grammars pays nothing"
    with pytest.raises(ValueError, match="regex"):
        llm.generate(["x"], SamplingParams(structured_outputs=S(regex="(")), use_tqdm=False)


def test_a_rejoining_request_replays_its_tokens_into_a_fresh_matcher(tiny_qwen2_vl):
    """Preemption, KV import and migration all rejoin through InputBatch.add: the mask after
    the replay equals the mask of a matcher that saw every step."""
    import torch
    from transformers import AutoTokenizer
    from triptych.engine.request import Request
    from triptych.engine.structured.grammar import GrammarState
    from triptych.engine.structured.grammar_compiler import GrammarCompiler

    tok = AutoTokenizer.from_pretrained(tiny_qwen2_vl)
    vocab = 640  # logits may be wider than the tokenizer (padded embeddings)
    comp = GrammarCompiler(tok, vocab, tok.eos_token_id)
    spec = StructuredOutputsParams(json=SCHEMAS[13], disable_any_whitespace=True)
    req = Request("r", [1, 2], SamplingParams(structured_outputs=spec))
    state = GrammarState()
    state.compile = comp.compile
    state.add(req)
    text = '{"color": "green", "size": "M"}'
    ids = tok.encode(text, add_special_tokens=False)
    for t in ids[:5]:
        state.accept("r", t)
        req.output_token_ids.append(t)
    live = state.mask(torch.zeros(1, vocab), ["r"])
    state.remove("r")
    assert "r" not in state and not state
    state.add(req)  # rejoins: the five tokens replayed
    assert torch.equal(state.mask(torch.zeros(1, vocab), ["r"]), live)
    allowed = torch.isfinite(live[0]).nonzero()[:, 0].tolist()
    assert ids[5] in allowed and len(allowed) < vocab
    for t in ids[5:]:
        state.accept("r", t)
    end = state.mask(torch.zeros(1, vocab), ["r"])
    assert torch.isfinite(end[0]).nonzero()[:, 0].tolist() == [tok.eos_token_id]
    bad = Request("b", [1], SamplingParams(structured_outputs=spec))
    bad.output_token_ids = tok.encode("[", add_special_tokens=False)
    with pytest.raises(ValueError, match="does not follow"):
        state.add(bad)
    comp.close()
