"""The house reads as the flow of a request: rooms import downwards only, no module imports
one that imports it back, and no file grows into a second engine.

Imports are read from the source (``ast``), at module level and inside functions alike:
a function-level import that closes a circle is still a circle a reader has to untangle.

Only the package's own files are read: the root's .py files and the package folders at the
root (those with an ``__init__.py``), everything below them. A ``.venv`` made inside the
clone (the README's set-up), ``tests/``, ``docs/`` or a build folder is never walked.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

POOLS = {"encode", "prefill", "decode"}
_TOP = POOLS | {"router", "api", "bench"}
# NOTE: what each room may NOT import. The flow of a request runs api -> router -> pools ->
# connector, all standing on worker / engine / models / parallel / kernels; a room never
# reaches up into the rooms that drive it, and one pool never imports another.
FORBIDDEN: dict[str, set[str]] = {
    "kernels": _TOP | {"engine", "worker", "parallel", "models", "mmcache", "connector"},
    "connector": _TOP | {"engine", "worker", "parallel", "models", "mmcache"},
    "mmcache": _TOP | {"parallel", "models"},
    "models": _TOP | {"worker"},
    "engine": _TOP | {"worker", "parallel"},
    "parallel": _TOP,
    "worker": _TOP,
    "encode": {"router", "api", "bench", "prefill", "decode"},
    "prefill": {"router", "api", "bench", "encode", "decode"},
    "decode": {"router", "api", "bench", "encode", "prefill"},
    "router": {"api", "bench"} | POOLS,
    "api": {"bench"} | POOLS,
}


def _package_files(root: Path = ROOT) -> list[Path]:
    """The package's .py files: the root's own and those under its package folders."""
    def walk(folder: Path) -> list[Path]:
        out: list[Path] = []
        for p in sorted(folder.iterdir()):
            if p.is_dir():
                top_pkg = folder != root or (p / "__init__.py").is_file()
                if top_pkg and not p.name.startswith((".", "__pycache__")):
                    out.extend(walk(p))
            elif p.suffix == ".py":
                out.append(p)
        return out
    return walk(root)


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for path in _package_files():
        rel = path.relative_to(ROOT)
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(["triptych", *parts])] = path
    return mods


def _imports(path: Path, name: str, mods: dict[str, Path]) -> set[str]:
    """The triptych modules ``name`` imports (``from pkg import mod`` resolves to pkg.mod)."""
    out: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("triptych"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name if is_pkg else name.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rsplit(".", 1)[0]
                base = f"{pkg}.{base}" if base else pkg
            if not base.startswith("triptych"):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in mods else base)
    return {m for m in out if m in mods and m != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(path, name, mods) for name, path in mods.items()}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and ROOT.joinpath(parts[1]).is_dir()) \
        else ""


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = _graph()
    # Tarjan-free: a depth-first search that reports the first cycle it walks into.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_rooms_import_downwards_only() -> None:
    wrong = sorted(f"{m} imports {d}" for m, deps in _graph().items() for d in deps
                   if _room(d) in FORBIDDEN.get(_room(m), set()))
    assert not wrong, "\n".join(wrong)


def test_no_file_is_a_second_engine() -> None:
    big = {str(p.relative_to(ROOT)): n for p in _modules().values()
           if (n := len(p.read_text().splitlines())) > 400}
    assert not big, f"files over 400 lines: {big}"


def test_the_room_table_in_the_architecture_doc_matches_the_folders() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rooms = sorted(p.name for p in ROOT.iterdir()
                   if p.is_dir() and (p / "__init__.py").exists())
    missing = [r for r in rooms if f"`{r}/`" not in doc]
    assert not missing, f"docs/architecture.md does not describe: {missing}"


def test_the_walk_reads_the_package_and_nothing_beside_it(tmp_path) -> None:
    """A .venv inside the clone (README's set-up), tests and docs are not the package."""
    for rel in ("__init__.py", "llm.py", "api/__init__.py", "api/server.py",
                "api/media/decode.py", ".venv/lib/python3.12/site-packages/big.py",
                ".venv/bin/activate_this.py", "tests/test_x.py", "docs/conf.py",
                "build/lib/triptych/llm.py", "api/__pycache__/server.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    found = sorted(str(p.relative_to(tmp_path)) for p in _package_files(tmp_path))
    assert found == ["__init__.py", "api/__init__.py", "api/media/decode.py", "api/server.py",
                     "llm.py"]


def test_every_folder_of_code_is_a_package_pyproject_installs() -> None:
    """A folder of modules missing from pyproject's list works in the editable install and
    is absent from a wheel."""
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())
                 ["tool"]["setuptools"]["packages"])
    folders = {p.parent for p in _package_files()}
    walked = {".".join(["triptych", *f.relative_to(ROOT).parts]) for f in folders}
    assert walked == listed, {"not listed": walked - listed, "listed, absent": listed - walked}
    no_init = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists())
    assert not no_init, f"folders without __init__.py: {no_init}"
