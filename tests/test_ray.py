"""Pools on Ray (distributed_executor_backend=ray) on a Ray cluster simulated on this host:
several raylets (ray.cluster_utils.Cluster), each pool pinned to its own node by a custom
resource. One cluster and one 1e1p1d server for the module, the tests in order:

  parity      greedy tokens equal HF's; /health names each worker's node, the pinned one
  grow        decode 1 -> 2 over POST /admin/pools: the new worker (on the other decode
              node) takes requests
  node lost   the node of the decode worker holding a stream is removed mid-stream, then
              the prefill node under another stream: both streams go on with unchanged
              greedy tokens; both workers come back on nodes added afterwards
  shrink      decode 2 -> 1 under load: every request succeeds, the drained worker and its
              placement group are gone
  SIGTERM     no actor, placement group or process of the server is left
And the start failures, in one line: a cluster that lacks a resource, one that is unreachable.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest

ray = pytest.importorskip("ray")

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import (
    ServerProc,
    data_url,
    image_part,
    img,
    png,
    text_part,
    user,
    wait_for,
)

MAX_TOKENS = 6
LONG = 450  # tokens of the streams that lose a node (max_model_len 512)
HB = "3"  # --worker-heartbeat-timeout: a lost node's worker is noticed within seconds


def _res(name: str) -> str:
    return json.dumps({name: 1})


@pytest.fixture(scope="module")
def cluster():
    """A node per pool (the head is the encode pool's); decode has two."""
    from ray.cluster_utils import Cluster

    before = _raylets()
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"enc_node": 1}, "include_dashboard": False})
    nodes = {"enc": c.head_node} | {name: c.add_node(num_cpus=1, resources={res: 1})
                                    for name, res in (("pre", "pre_node"), ("dec1", "dec_node"),
                                                      ("dec2", "dec_node"))}
    ray.init(address=c.address, log_to_driver=False)  # this test is a driver too (tables)
    try:
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()
        wait_for(lambda: _raylets() <= before, "the test cluster's raylets to exit")


@pytest.fixture(scope="module")
def server(cluster, tiny_qwen2_vl, tmp_path_factory):
    c, _ = cluster
    s = ServerProc(tiny_qwen2_vl, tmp_path_factory.mktemp("ray") / "serve.log",
                   "--block-size", "4", "--max-model-len", "512", "--served-model-name", "tiny",
                   "--encode-workers", "1", "--prefill-workers", "1", "--decode-workers", "1",
                   "--distributed-executor-backend", "ray", "--ray-address", c.address,
                   "--encode-resources", _res("enc_node"), "--prefill-resources",
                   _res("pre_node"), "--decode-resources", _res("dec_node"),
                   "--worker-heartbeat-timeout", HB, "--kv-cache-memory", "32MiB",
                   "--admin-api-key", "ray-test-operator-key")
    try:
        yield s
    finally:
        s.stop(signal.SIGKILL)
        s.cleanup_descendants()


def _raylets() -> set[int]:
    return {p for p in _pids() if "raylet" in _cmd(p)}


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmd(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _workers(s: ServerProc, pool: str) -> list[dict]:
    return httpx.get(s.base + "/health", headers=s.admin_headers,
                     timeout=10).json()["pools"][pool]["workers"]


def _up(s: ServerProc, pool: str) -> list[dict]:
    return [w for w in _workers(s, pool) if w["state"] == "up" and w["node"]]


def _resize(s: ServerProc, pool: str, n: int) -> dict:
    r = httpx.post(s.base + "/admin/pools", json={"pool": pool, "workers": n},
                   headers=s.admin_headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _ask(s: ServerProc, msgs: list[dict], max_tokens: int = MAX_TOKENS) -> list[int]:
    r = s.openai_client(timeout=120).chat.completions.create(
        model="tiny", messages=msgs, temperature=0, max_tokens=max_tokens,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.choices[0].model_extra["token_ids"]


def test_an_unreachable_cluster_fails_at_start(tiny_qwen2_vl):
    """First in the module: this process is no Ray driver yet."""
    import asyncio

    from server_fixtures import free_port
    from transformers import AutoTokenizer
    from triptych.config import EngineConfig
    from triptych.router.errors import ClusterError
    from triptych.router.router import Router

    address = f"127.0.0.1:{free_port()}"
    config = EngineConfig(model=tiny_qwen2_vl, decode_workers=1, ray_address=address,
                          distributed_executor_backend="ray")
    router = Router(config, AutoTokenizer.from_pretrained(tiny_qwen2_vl))
    try:
        with pytest.raises(ClusterError, match=f"cannot reach the Ray cluster at {address}"):
            asyncio.run(router.start())
    finally:
        asyncio.run(router.shutdown())


TEXT = user(text_part("Tell me a story about a cat."))


def test_pools_on_ray_nodes_equal_hf(server, cluster, tiny_qwen2_vl):
    from triptych.api.processor import InputProcessor
    from triptych.models.hf_oracle import hf_greedy, load_hf_model

    _, nodes = cluster
    where = {pool: {w["node"]["node_id"] for w in _up(server, pool)}
             for pool in ("encode", "prefill", "decode")}
    assert where["encode"] == {nodes["enc"].node_id}
    assert where["prefill"] == {nodes["pre"].node_id}
    assert where["decode"] <= {nodes["dec1"].node_id, nodes["dec2"].node_id}
    proc = InputProcessor(tiny_qwen2_vl, max_model_len=512)
    hf = load_hf_model(tiny_qwen2_vl)
    pad = proc.tokenizer.pad_token_id or 0
    pic = img(1, 56, 84)
    for http_msgs, offline in (
            (user(image_part(data_url(png(pic))), text_part("What is it?")),
             [{"role": "user", "content": [{"type": "image", "image": pic},
                                           {"type": "text", "text": "What is it?"}]}]),
            (TEXT, TEXT)):
        want = hf_greedy(hf, proc.process_chat(offline), MAX_TOKENS, pad)[0]
        assert _ask(server, http_msgs) == want


def test_growing_decode_takes_requests_on_the_new_worker(server, cluster):
    _, nodes = cluster
    want = _ask(server, TEXT)
    assert _resize(server, "decode", 2)["added"] == ["decode-1"]
    wait_for(lambda: len(_up(server, "decode")) == 2, "the new decode worker", timeout=180)
    assert {w["node"]["node_id"] for w in _up(server, "decode")} == \
        {nodes["dec1"].node_id, nodes["dec2"].node_id}
    with cf.ThreadPoolExecutor(6) as ex:
        assert list(ex.map(lambda _: _ask(server, TEXT), range(6))) == [want] * 6
    served = {w["name"]: w["served"] for w in _workers(server, "decode")}
    assert served["decode-1"] >= 1, served


def _stream_while(server: ServerProc, msgs: list[dict], max_tokens: int, after: int,
                  act) -> list[int]:
    """Stream a greedy answer; once ``after`` tokens arrived, ``act()``; the token ids."""
    client = server.openai_client(timeout=180)
    got: list[int] = []
    started = threading.Event()

    def stream() -> None:
        for chunk in client.chat.completions.create(
                model="tiny", messages=msgs, temperature=0, max_tokens=max_tokens,
                stream=True, extra_body={"ignore_eos": True, "return_token_ids": True}):
            if chunk.choices:
                got.extend(chunk.choices[0].model_extra.get("token_ids") or [])
                if len(got) >= after:
                    started.set()

    with cf.ThreadPoolExecutor(1) as ex:
        done = ex.submit(stream)
        assert started.wait(120)
        act()
        done.result(timeout=180)
    return got


def _node_of(nodes: dict, worker: dict) -> str:
    return next(k for k, n in nodes.items() if n.node_id == worker["node"]["node_id"])


def _lose_node(c, nodes: dict, worker: dict) -> None:
    """The host under ``worker`` is lost: its node goes, and its processes with it. Ray's
    local Cluster only stops the node's raylet, and a worker busy in its loop notices that
    ~1 s later, long enough on a quiet box for a whole stream to finish there untouched (the
    test then saw no migration); a host that dies takes every process at once."""
    c.remove_node(nodes.pop(_node_of(nodes, worker)), allow_graceful=False)
    try:
        os.kill(int(worker["pid"]), signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone with its raylet


def test_losing_nodes_mid_stream(server, cluster):
    """The decode node of a stream, then the prefill node under another: both streams end
    with the undisturbed greedy tokens; both workers come back on nodes added after."""
    c, nodes = cluster
    msgs = user(text_part("Write a long story."))
    # NOTE: long enough that the node is gone well before the stream could end
    want = _ask(server, msgs, LONG)
    migrations = server.metric("triptych:request_migrations_total")
    lost: dict[str, dict] = {}

    def lose_decode() -> None:
        holder = wait_for(lambda: next((w for w in _up(server, "decode") if w["requests"]),
                                       None), "the decode worker holding the stream")
        lost["decode"] = holder
        _lose_node(c, nodes, holder)

    assert _stream_while(server, msgs, LONG, 1, lose_decode) == want
    assert server.metric("triptych:request_migrations_total") > migrations
    nodes["dec3"] = c.add_node(num_cpus=1, resources={"dec_node": 1})  # its worker waits

    def lose_prefill() -> None:
        (prefill,) = _up(server, "prefill")
        lost["prefill"] = prefill
        _lose_node(c, nodes, prefill)

    # the stream is in its decode worker's hands: the prefill node's loss does not touch it
    assert _stream_while(server, msgs, LONG, 8, lose_prefill) == want
    nodes["pre2"] = c.add_node(num_cpus=1, resources={"pre_node": 1})
    for pool, node in (("decode", "dec3"), ("prefill", "pre2")):
        name = lost[pool]["name"]
        w = wait_for(lambda pool=pool, name=name: next(
            (w for w in _up(server, pool) if w["name"] == name), None),
                     f"{name} back on the new node", timeout=180)
        assert w["node"]["node_id"] == nodes[node].node_id and w["restarts"] >= 1
    assert _ask(server, msgs, LONG) == want  # through the replaced prefill worker


def test_1e2p2d_on_ray_nodes_equals_hf(server, cluster, tiny_qwen2_vl):
    """Grown to 1e2p2d (a second prefill worker on a new prefill node): every worker serves,
    and greedy tokens through both prefill workers equal HF's (text and image prompts).
    Distinct prompts, sent 4 at a time: the router is prefix-aware, so prompts the first
    prefill worker already served would rightly go back to it."""
    from triptych.api.processor import InputProcessor
    from triptych.models.hf_oracle import hf_greedy, load_hf_model

    c, nodes = cluster
    proc = InputProcessor(tiny_qwen2_vl, max_model_len=512)
    hf, pad = load_hf_model(tiny_qwen2_vl), proc.tokenizer.pad_token_id or 0
    pic = img(1, 56, 84)
    asks, want = [], []
    for k in range(8):
        q = f"Round {k}: what is it?"
        offline = [{"role": "user", "content": ([{"type": "image", "image": pic}] if k % 2
                                                else []) + [{"type": "text", "text": q}]}]
        asks.append(user(*([image_part(data_url(png(pic)))] if k % 2 else []), text_part(q)))
        want.append(hf_greedy(hf, proc.process_chat(offline), MAX_TOKENS, pad)[0])
    nodes["pre3"] = c.add_node(num_cpus=1, resources={"pre_node": 1})
    assert _resize(server, "prefill", 2)["added"] == ["prefill-1"]
    wait_for(lambda: len(_up(server, "prefill")) == 2 and len(_up(server, "decode")) == 2,
             "1e2p2d up", timeout=180)
    assert len({w["node"]["node_id"] for w in _up(server, "prefill")}) == 2
    before = {w["name"]: w["served"] for p in ("prefill", "decode") for w in _workers(server, p)}
    with cf.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda m: _ask(server, m), asks))
    assert got == want
    after = {w["name"]: w["served"] for p in ("prefill", "decode") for w in _workers(server, p)}
    assert sorted(after) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    assert after["prefill-1"] > before.get("prefill-1", 0), after


def test_shrinking_drains_without_a_failed_request(server):
    for body in ({"pool": "vision", "workers": 1}, {"pool": "decode", "workers": 0},
                 {"pool": "decode", "workers": "2"}):
        r = httpx.post(server.base + "/admin/pools", json=body, headers=server.admin_headers,
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("pool", "workers")
    want = _ask(server, TEXT, 60)
    with cf.ThreadPoolExecutor(4) as ex:
        asks = [ex.submit(_ask, server, TEXT, 60) for _ in range(4)]
        wait_for(lambda: all(w["requests"] for w in _up(server, "decode")),
                 "both decode workers busy", timeout=60)
        assert _resize(server, "decode", 1)["draining"] == ["decode-1"]
        assert [a.result(timeout=180) for a in asks] == [want] * 4
    wait_for(lambda: [w["name"] for w in _workers(server, "decode")] == ["decode-0"],
             "the drained worker gone", timeout=60)
    assert httpx.get(server.base + "/admin/pools", headers=server.admin_headers,
                     timeout=10).json()["pools"]["decode"] == 1
    assert not [p for p in _placement_groups(server) if "decode-1" in p["name"]]


def _placement_groups(s: ServerProc) -> list[dict]:
    """The server's placement groups that still exist."""
    from ray.util import placement_group_table

    return [p for p in placement_group_table().values()
            if p["name"].startswith(f"triptych-{s.proc.pid}-") and p["state"] != "REMOVED"]


def test_sigterm_leaves_no_actor_or_placement_group(server):
    n = sum(httpx.get(server.base + "/admin/pools", headers=server.admin_headers,
                      timeout=10).json()["pools"].values())
    assert n >= 3  # 1e2p1d here, after the tests above grew and shrank it
    assert len(_placement_groups(server)) == n
    actors = {p for p in _pids() if _cmd(p).startswith("ray::PoolWorkerActor")}
    assert len(actors) == n
    assert server.stop(signal.SIGTERM, timeout=90) in (0, -signal.SIGTERM)  # its own exit
    assert "Application shutdown complete" in server.log_path.read_text()
    wait_for(lambda: not _placement_groups(server), "the placement groups removed")
    wait_for(lambda: not any(os.path.exists(f"/proc/{p}") and
                             _cmd(p).startswith("ray::PoolWorkerActor") for p in actors),
             "every worker actor gone")


def test_missing_resources_fail_in_one_line(cluster, tiny_qwen2_vl):
    c, _ = cluster
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    p = subprocess.run([sys.executable, "-m", "triptych", "serve", "--model", tiny_qwen2_vl,
                        "--decode-workers", "1", "--distributed-executor-backend", "ray",
                        "--ray-address", c.address, "--decode-resources", _res("gpu_node")],
                       check=False, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2, p.stderr[-3000:]
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("triptych: error: the Ray cluster cannot place decode worker") \
        and "gpu_node" in line and "--decode-resources" in line, line


def test_ray_knobs_are_checked_before_anything_starts():
    from triptych.config import EngineConfig

    ok = EngineConfig(model="m", decode_workers=1, distributed_executor_backend="ray",
                      decode_resources='{"dec_node": 0.5}')
    assert ok.decode_resources == {"dec_node": 0.5}
    for bad, what in (
            ({"distributed_executor_backend": "slurm"}, "mp or ray"),
            ({"decode_resources": '{"dec_node": 1}'}, "needs distributed_executor_backend=ray"),
            ({"distributed_executor_backend": "ray", "decode_resources": "[1]"}, "JSON object"),
            ({"distributed_executor_backend": "ray", "decode_resources": '{"x": -1}'},
             "non-negative"),
            ({"distributed_executor_backend": "ray", "kv_transfer": "shm"}, "auto or tcp"),
            ({"ray_address": "10.0.0.1:6379"}, "needs distributed_executor_backend=ray")):
        with pytest.raises(ValueError, match=what):
            EngineConfig(model="m", decode_workers=1, **bad)
