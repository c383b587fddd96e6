"""Build a C++ torch operator library from kernels/cpu/csrc/ on first use, once per machine.

``load_library("cpu_paged_attention")`` compiles ``csrc/cpu_paged_attention.cpp`` with the
host's g++ (``-O3 -march=native -fopenmp``, against the installed torch's headers and
libraries) into a cache directory and loads it with ``torch.ops.load_library``; later
processes find the built library and only load it (~10 ms).

Why not ``torch.utils.cpp_extension.load``: it needs ninja and builds a Python module
with pybind11 headers (~3x the compile time); the operator registers itself through
``TORCH_LIBRARY`` instead, so one plain compiler call is all it takes.

- Cache: ``$TORCH_EXTENSIONS_DIR/triptych`` (torch's own knob for JIT-built extensions;
  default ``~/.cache/torch_extensions/triptych``), one file per (source, torch version,
  compiler, flags, CPU features): a new torch, an edited source or another CPU builds
  afresh; a rebuild never overwrites a library another process has loaded.
- Concurrency: workers starting together take an exclusive ``flock`` on the target's
  lock file; the first builds into a temporary name and renames it into place (atomic),
  the others wait and then load the finished file.
- No compiler, or a failed build: ``BuildError`` with the compiler's message; callers fall
  back to the plain-torch kernels and log what to install.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger("triptych.cpu_build")

CSRC = Path(__file__).resolve().parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-w")
BUILD_TIMEOUT_S = 600  # a loaded 2-core box takes ~10-30 s


class BuildError(RuntimeError):
    """The operator library could not be built or loaded here."""


def cache_dir() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / "triptych"


def compiler() -> str | None:
    """The C++ compiler to use: $CXX if set, else g++ / c++ on PATH."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or None
    return shutil.which("g++") or shutil.which("c++")


def _cpu_features() -> str:
    # -march=native binds the binary to this CPU: its flags are part of the cache key.
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return os.uname().machine


def _command(cxx: str, src: Path, out: Path) -> list[str]:
    from torch.utils import cpp_extension  # noqa: PLC0415 (only when building)

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    inc = [f"-I{p}" for p in cpp_extension.include_paths()]
    lib = [f"-L{p}" for p in cpp_extension.library_paths()]
    rpath = [f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()]
    return [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *inc, str(src), *lib, *rpath,
            "-lc10", "-ltorch_cpu", "-o", str(out)]


def library_path(name: str) -> tuple[Path, list[str]]:
    """Where ``name``'s built library lives on this machine, and the command that builds it."""
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (install g++, or set CXX)")
    src = CSRC / f"{name}.cpp"
    cmd = _command(cxx, src, Path("OUT"))
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             timeout=60, check=False).stdout.splitlines()[:1]
    key = hashlib.sha256("\n".join([
        src.read_text(), torch.__version__, sys.version, sysconfig.get_platform(),
        " ".join(cmd), *version, _cpu_features()]).encode()).hexdigest()[:16]
    return cache_dir() / f"{name}-{key}.so", cmd


def build(name: str) -> Path:
    """The built library of ``csrc/<name>.cpp``, compiling it now if this machine has none."""
    path, cmd = library_path(name)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        if path.exists():
            return path
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        cmd[-1] = str(tmp)
        logger.info("compiling the CPU kernel %s once for this machine (%s); "
                    "later starts load it from the cache", name, path)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise BuildError(f"compiling {name} failed: {e}") from e
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise BuildError(f"compiling {name} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
        os.replace(tmp, path)
        logger.info("compiled %s in %.1f s", name, time.perf_counter() - t0)
    return path


_loaded: dict[str, Path] = {}
_lock = threading.Lock()  # threads of one process: the flock above is per open file


_usable: dict[str, bool] = {}


def usable(name: str, logger: logging.Logger, without: str) -> bool:
    """``load_library(name)`` once per process: whether it worked. When it did not, says so
    once on ``logger``: ``without`` is what runs instead (the kernel modules' fallbacks)."""
    if name not in _usable:
        try:
            load_library(name)
            _usable[name] = True
        except BuildError as e:
            logger.warning("%s (install g++ to get it): %s", without, e)
            _usable[name] = False
    return _usable[name]


def load_library(name: str) -> Path:
    """Build (if needed) and load ``csrc/<name>.cpp`` into this process's torch.ops."""
    with _lock:
        return _load(name)


def _load(name: str) -> Path:
    if name not in _loaded:
        path = build(name)
        try:
            torch.ops.load_library(str(path))
        except OSError as e:
            raise BuildError(f"loading {path} failed: {e}") from e
        _loaded[name] = path
    return _loaded[name]
