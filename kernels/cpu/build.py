"""Build a C++ torch operator library from kernels/cpu/csrc/ on first use, once per machine.

``load_library("cpu_gemv")`` compiles ``csrc/cpu_gemv/`` with the host's g++ into a cache
directory and loads it with ``torch.ops.load_library``; later processes find the built
library and only load it (~10 ms). One library holds every instruction-set variant of its
kernels the compiler supports (kernels/cpu/isa.py):

    op.cpp        the torch op (checks, threads, dispatch): once, no -m flags
    kernels.cpp   the kernels: once per variant, -DTRIPTYCH_VARIANT=<id> and its -m flags

so the build never assumes the CPU it runs on (no ``-march=native``: a cache built on an
AVX-512 box serves an AVX2-only one from the same files), and each call names the variant
the platform chose for this CPU. Kernel copies hold only small, torch-free code (simd.h says
why), so the variants cost ~1 s of compiling each beside the op's ~5-10 s of torch headers.

Why not ``torch.utils.cpp_extension.load``: it needs ninja and builds a Python module
with pybind11 headers (~3x the compile time); the operator registers itself through
``TORCH_LIBRARY`` instead, so plain compiler calls are all it takes.

- Cache: ``$TORCH_EXTENSIONS_DIR/triptych`` (torch's own knob for JIT-built extensions;
  default ``~/.cache/torch_extensions/triptych``), one file per (sources, torch version,
  compiler, flags): a new torch or an edited source builds afresh; a rebuild never
  overwrites a library another process has loaded.
- Concurrency: workers starting together take an exclusive ``flock`` on the target's
  lock file; the first builds into a temporary name and renames it into place (atomic),
  the others wait and then load the finished file.
- No compiler, or a failed build: ``BuildError`` with the compiler's message; callers fall
  back to the plain-torch kernels and log what to install. A variant the compiler does not
  know (an old g++, another architecture) is left out of the build: the library holds the
  others, and ``variants()`` says which.
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
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from triptych.kernels.cpu import isa

logger = logging.getLogger("triptych.cpu_build")

CSRC = Path(__file__).resolve().parent / "csrc"
COMMON = ("-O3", "-fPIC", "-std=c++20", "-w")
OP_FLAGS = (*COMMON, "-fopenmp")  # at::parallel_for's OpenMP regions are compiled in here
KERNEL_FLAGS = (*COMMON, "-fopenmp-simd")  # `omp simd` loops only: no OpenMP runtime
BUILD_TIMEOUT_S = 600  # a loaded 2-core box takes ~10-40 s


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


def _torch_flags() -> tuple[list[str], list[str]]:
    from torch.utils import cpp_extension  # noqa: PLC0415 (only when building)

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    inc = [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in cpp_extension.include_paths())]
    libs = [*(f"-L{p}" for p in cpp_extension.library_paths()),
            *(f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu"]
    return inc, libs


def _kernel_command(cxx: str, name: str, variant: str) -> list[str]:
    flags = isa.VARIANTS[variant][0]
    return [cxx, *KERNEL_FLAGS, *flags, f"-DTRIPTYCH_VARIANT={isa.NAMES.index(variant)}",
            "-c", str(CSRC / name / "kernels.cpp"), "-o", f"kernels-{variant}.o"]


def _op_command(cxx: str, name: str, built: list[str]) -> list[str]:
    inc, _ = _torch_flags()
    mask = sum(1 << isa.NAMES.index(v) for v in built)
    return [cxx, *OP_FLAGS, *inc, f"-DTRIPTYCH_BUILT={mask}", "-c", str(CSRC / name / "op.cpp"),
            "-o", "op.o"]


def _link_command(cxx: str, built: list[str], out: str) -> list[str]:
    _, libs = _torch_flags()
    return [cxx, "-shared", "-fopenmp", "op.o", *(f"kernels-{v}.o" for v in built), *libs,
            "-o", out]


def _sources(name: str) -> list[Path]:
    return sorted([*(CSRC / name).iterdir(), *CSRC.glob("*.h")])


def library_path(name: str) -> Path:
    """Where ``name``'s built library lives on this machine (the key: its sources, the
    torch, Python and compiler it is built with, and every variant's flags)."""
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (install g++, or set CXX)")
    if not (CSRC / name / "op.cpp").exists():
        raise BuildError(f"no sources for {name} in {CSRC}")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             timeout=60, check=False).stdout.splitlines()[:1]
    commands = [" ".join(_kernel_command(cxx, name, v)) for v in isa.NAMES]
    key = hashlib.sha256("\n".join([
        *(p.read_text() for p in _sources(name)), torch.__version__, sys.version,
        sysconfig.get_platform(), " ".join(_op_command(cxx, name, list(isa.NAMES))),
        " ".join(_link_command(cxx, list(isa.NAMES), "OUT")), *commands, *version,
    ]).encode()).hexdigest()[:16]
    return cache_dir() / f"{name}-{key}.so"


def _run(cmd: list[str], cwd: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"{' '.join(cmd[:1])} failed: {e}") from e


def compiler_variants(cxx: str, workdir: str) -> list[str]:
    """The variants whose flags this compiler takes (an empty file compiled with each)."""
    probe = Path(workdir) / "probe.cpp"
    probe.write_text("int triptych_probe;\n")
    ok = []
    for v in isa.NAMES:
        proc = _run([cxx, *COMMON, *isa.VARIANTS[v][0], "-c", str(probe), "-o", "probe.o"],
                    workdir)
        if proc.returncode == 0:
            ok.append(v)
    return ok


def _compile(name: str, cxx: str, out: Path) -> list[str]:
    """Compile every variant the compiler takes and the op, in parallel, and link them into
    ``out``; returns the variants built."""
    with tempfile.TemporaryDirectory(prefix=f"{name}-", dir=out.parent) as work:
        variants = compiler_variants(cxx, work)
        skipped = [v for v in isa.NAMES if v not in variants]
        if skipped:
            logger.info("%s: the compiler takes no flags for %s: built without them", name,
                        ", ".join(skipped))
        jobs = [_op_command(cxx, name, variants),
                *(_kernel_command(cxx, name, v) for v in variants)]
        with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as ex:
            procs = list(ex.map(lambda c: (c, _run(c, work)), jobs))
        for cmd, proc in procs:
            if proc.returncode != 0:
                raise BuildError(f"compiling {name} failed ({' '.join(cmd)}):\n"
                                 f"{proc.stderr[-2000:]}")
        link = _link_command(cxx, variants, str(out))
        proc = _run(link, work)
        if proc.returncode != 0:
            raise BuildError(f"linking {name} failed ({' '.join(link)}):\n{proc.stderr[-2000:]}")
    return variants


def build(name: str) -> Path:
    """The built library of ``csrc/<name>/``, compiling it now if this machine has none."""
    path = library_path(name)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        if path.exists():
            return path
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        logger.info("compiling the CPU kernel %s once for this machine, every instruction-set "
                    "variant the compiler takes (%s); later starts load it from the cache",
                    name, path)
        t0 = time.perf_counter()
        try:
            variants = _compile(name, compiler() or "g++", tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)
        logger.info("compiled %s (%s) in %.1f s", name, ", ".join(variants),
                    time.perf_counter() - t0)
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
    """Build (if needed) and load ``csrc/<name>/`` into this process's torch.ops."""
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
