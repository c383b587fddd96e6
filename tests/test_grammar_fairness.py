"""Grammar compiles are bounded and fair (issue 36, rows 3 and 4's P0 half), against a
real server with two tenants and the real openai client: deep schemas from one tenant are
killed at --grammar-compile-timeout in their own share of the compile processes while the
other tenant's json_object goes through; a queued compile's wait is not counted against
its timeout; a schema past --max-structured-depth and a grammar that matches nothing are
400s naming the problem."""
from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import openai
from server_fixtures import _children, alive, module_server, wait_for

KEYS = {"alice": "key-alice-0123456789", "bob": "key-bob-0123456789"}
DEEP = 600  # arrays nested this deep compile for many seconds on the tiny vocabulary
HI = [{"role": "user", "content": "Answer."}]


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    path.chmod(0o600)
    yield from module_server(tiny_qwen2_vl, tmp_path_factory,
                             "--max-model-len", "512", "--served-model-name", "tiny",
                             "--api-keys-file", str(path), "--max-structured-depth", "650",
                             "--grammar-compile-timeout", "2")


def client(server, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEYS[tenant], max_retries=0,
                         timeout=300)


def deep(n: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema


def ask(c: openai.OpenAI, schema: dict | None = None, **extra):
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}} \
        if schema is not None else {"type": "json_object"}
    return c.chat.completions.create(model="tiny", messages=HI, max_tokens=8, temperature=0,
                                     response_format=rf, extra_body=extra or None)


def refusal(c: openai.OpenAI, schema: dict | None = None, **extra) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        ask(c, schema, **extra)
    return e.value.response.json()["error"]["message"]


def compile_procs(server) -> dict[int, float]:
    """P0's compile processes: pid -> CPU seconds so far."""
    out = {}
    for pid in _children(server.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"triptych.api.grammar_proc" not in f.read():
                    continue
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            continue
    return out


def test_deep_schemas_of_one_tenant_do_not_fail_anothers_json_object(server):
    alice, bob = client(server, "alice"), client(server, "bob")
    # the compile processes are up (json_object's verdict is not kept: it comes below)
    assert bob.chat.completions.create(model="tiny", messages=HI, max_tokens=2, extra_body={
        "structured_outputs": {"regex": "[ab]+"}}).choices
    before = compile_procs(server)
    done: list[str] = []

    def attack(i: int) -> str:
        msg = refusal(alice, deep(DEEP + i))  # distinct specs: no verdict shared
        done.append(f"alice-{i}")
        return msg

    with ThreadPoolExecutor(3) as ex:
        attacks = [ex.submit(attack, i) for i in range(3)]
        busy = wait_for(lambda: [p for p, cpu in compile_procs(server).items()
                                 if cpu > before.get(p, 0.0) + 0.5],
                        "one of alice's compiles running", timeout=120)
        out = ask(bob)  # json_object, compiled now
        done.append("bob")
        assert out.choices[0].finish_reason in ("stop", "length")
        for a in attacks:
            assert "--grammar-compile-timeout" in a.result(timeout=600)
    # bob did not queue behind alice: her compiles end one at a time, two s apart at least
    assert done.index("bob") < 2, done
    assert not [p for p in busy if alive(p)], "a timed-out compile's process lives on"


def test_a_queued_compile_does_not_spend_its_timeout_waiting(server):
    """Alice's share is one compile at a time: her small schema waits behind her deep one
    (killed at 2 s, then its process restarts) and still compiles."""
    alice = client(server, "alice")
    with ThreadPoolExecutor(2) as ex:
        slow = ex.submit(refusal, alice, deep(DEEP + 10))
        wait_for(lambda: any(cpu > 0.5 for cpu in compile_procs(server).values()),
                 "alice's deep compile running", timeout=120)
        small = ask(alice, {"type": "array", "items": {"type": "boolean"}, "maxItems": 2})
        assert small.choices[0].finish_reason in ("stop", "length")
        assert "--grammar-compile-timeout" in slow.result(timeout=600)


def test_depth_limit_and_empty_grammar_are_400s_naming_the_problem(server):
    bob = client(server, "bob")
    assert "--max-structured-depth" in refusal(bob, deep(700))
    assert "nests 70" in refusal(bob, deep(700))
    with pytest.raises(openai.BadRequestError) as e:
        bob.chat.completions.create(model="tiny", messages=HI, max_tokens=4, extra_body={
            "structured_outputs": {"grammar": "root ::= root"}})
    assert "matches no output" in e.value.response.json()["error"]["message"]
    assert bob.chat.completions.create(model="tiny", messages=HI, max_tokens=4, extra_body={
        "structured_outputs": {"grammar": 'root ::= "a" root | "b"'}}).choices
    # one that starts (P0 passes it) and has no way on: the worker ends it alone
    r = bob.chat.completions.create(model="tiny", messages=HI, max_tokens=4, extra_body={
        "structured_outputs": {"grammar": 'root ::= "a" b\nb ::= b'}})
    assert r.choices[0].finish_reason == "error" and r.choices[0].message.content == "a"
