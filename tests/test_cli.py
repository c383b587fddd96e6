"""The command line as a new user meets it: each default shown once in --help, vLLM's flag
spellings, --model checked in one line before anything starts (offline: no download is
ever tried here), and `triptych chat` keeping log lines out of its answers."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import img, png

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def help_blocks(text: str) -> dict[str, str]:
    """option strings -> their help text (argparse wraps it over several lines)."""
    blocks: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if line.startswith("  -"):
            key = line.split("  ")[1].strip() if "  " in line.strip() else line.strip()
            blocks[key] = " ".join(line.split())
        elif key and line.startswith("    "):
            blocks[key] += " " + " ".join(line.split())
        else:
            key = None
    return blocks


def run_help(capsys, *argv: str) -> dict[str, str]:
    from triptych.cli import main
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return help_blocks(capsys.readouterr().out)


@pytest.mark.parametrize("argv", [("serve",), ("chat",), ("make-tiny",),
                                  ("bench", "throughput"), ("bench", "serve")])
def test_help_shows_each_default_once(capsys, argv):
    blocks = run_help(capsys, *argv)
    assert blocks
    for opt, text in blocks.items():
        assert text.count("(default") <= 1, (opt, text)
    if argv == ("make-tiny",):
        (out,) = [t for o, t in blocks.items() if o.startswith("--out")]
        assert "default" not in out  # required: no default to show
    if argv == ("serve",):
        shown = {o.split()[0].rstrip(","): t for o, t in blocks.items()}
        for flag, default in (("--port", "8000"), ("--max-n", "16"), ("--block-size", "16"),
                              ("--max-pending-requests", "256"), ("--video-fps", "2.0"),
                              ("--max-video-pixels", "128000000"), ("--seed", "0"),
                              ("--media-fetch-timeout", "10.0")):
            assert f"(default: {default})" in shown[flag], shown[flag]
        assert "min(checkpoint max, 8192)" in shown["--max-model-len"]
        assert any(o.startswith("--num-gpu-blocks-override") and "--num-kv-blocks" in o
                   for o in blocks)
        assert any(o.startswith("--allowed-media-domains") and "--allowed-domains" in o
                   for o in blocks)
    if argv == ("chat",):
        assert "demo checkpoint" in " ".join(blocks.values())


def test_vllm_spellings_and_aliases():
    from triptych.api import serve_cmd
    from triptych.cli import ArgumentParser
    from triptych.config import EngineConfig

    p = ArgumentParser(prog="t")
    serve_cmd.add_parser(p.add_subparsers(dest="cmd", parser_class=ArgumentParser))
    for argv, want in ((["--num-gpu-blocks-override", "6"], 6), (["--num-kv-blocks", "5"], 5)):
        assert p.parse_args(["serve", *argv]).num_kv_blocks == want
    for flag in ("--allowed-media-domains", "--allowed-domains"):
        assert p.parse_args(["serve", flag, "a.example"]).allowed_media_domains == "a.example"
    assert p.parse_args(["serve", "--kv-cache-memory-bytes", "2GiB"]).kv_cache_memory == "2GiB"
    assert EngineConfig.from_kwargs(model="m", num_gpu_blocks_override=7).num_kv_blocks == 7
    with pytest.raises(TypeError):
        EngineConfig.from_kwargs(model="m", num_gpu_blocks_override=7, num_kv_blocks=7)
    assert isinstance(p, argparse.ArgumentParser)


def one_line_error(*argv: str, env: dict | None = None) -> str:
    r = subprocess.run([sys.executable, "-m", "triptych", *argv], capture_output=True,
                       text=True, timeout=60, env=env or ENV, check=False)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("triptych: error:"), r.stderr
    return lines[0]


def test_model_is_checked_before_anything_starts(tmp_path):
    assert "no such directory" in one_line_error("serve", "--model", str(tmp_path / "nope"))
    assert "no config.json" in one_line_error("serve", "--model", str(tmp_path))
    (tmp_path / "f").write_text("x")
    assert "is a file" in one_line_error("chat", "--model", str(tmp_path / "f"))
    env = {**ENV, "HF_HOME": str(tmp_path / "hf")}
    line = one_line_error("serve", "--model", "Qwen/Qwen2-VL-2B-Instruct", env=env)
    assert "HF_HUB_OFFLINE" in line and "hf download Qwen/Qwen2-VL-2B-Instruct" in line
    assert "port" not in one_line_error("serve", "--model", str(tmp_path), "--max-n", "0")


def test_hub_id_found_in_the_cache_needs_no_network(tmp_path):
    snap = tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc123")
    code = "from triptych.cli import resolve_model; print(resolve_model('org/tiny'))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env={**ENV, "HF_HOME": str(tmp_path / "hf")}, check=False)
    assert r.returncode == 0 and r.stdout.strip() == str(snap), r.stderr


def test_chat_keeps_logs_out_of_answers(tiny_qwen2_vl, tmp_path):
    (tmp_path / "a.png").write_bytes(png(img(1)))
    script = f"/image {tmp_path}/a.png\nWhat is it?\n/image {tmp_path}/none.png\n/reset\n"
    r = subprocess.run([sys.executable, "-m", "triptych", "chat", "--model", tiny_qwen2_vl,
                        "--max-tokens", "3", "--block-size", "4", "--max-model-len", "256",
                        "--allowed-local-media-path", str(tmp_path)],
                       input=script, capture_output=True, text=True, timeout=300, env=ENV,
                       cwd=tmp_path, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert f"attached {tmp_path}/a.png" in out and "no such file" in out
    assert "assistant> " in out and "(new conversation)" in out
    assert not re.search(r"INFO|WARNING|running \d+, waiting", out)
    assert not re.search(r"running \d+, waiting", r.stderr)  # no stats lines at all
