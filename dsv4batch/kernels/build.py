"""Building the CPU kernels (``csrc/``) as torch ops, once per node and instruction set.

``torch.utils.cpp_extension.load`` (its JIT: ninja, torch's own compile flags) builds the sources
into a library that registers ``torch.ops.dsv4batch.<op>.<isa>``, one overload per ISA, so
libraries built for two ISAs can be loaded into one process (tests, the bench's ``--isa``).

========= ========================= ===========================================================
ISA       flags                     vector registers (the kernels' blocks are sized to them)
========= ========================= ===========================================================
avx512    ``-march=x86-64-v4``      32 x 16 floats (AVX-512 F/BW/CD/DQ/VL)
avx2      ``-march=x86-64-v3``      16 x 8 floats (AVX2 + FMA): any x86 CPU since ~2015
generic   the compiler's default    4-float vectors (SSE2 on x86-64, NEON on arm64)
========= ========================= ===========================================================

``native`` is the best of these this CPU runs (`native_isa`). A build is keyed by the sources, the
flags, the compiler and torch's version, in its own folder under :func:`cache_dir`, so every
process on a node reuses it (~0.1 s to load) and a changed source builds beside the old one.
Processes that start together build one at a time: a file lock (``filelock``, released when its
holder dies) is held around torch's build, and a build folder's stale torch lock (left by a
killed build) is removed under it. Why JIT and not a build at ``pip install``: that needs torch
in pip's build environment (an isolated one would download a second, multi-GB torch) and would
have to build every ISA; the JIT builds the one this CPU runs, once (~40 s on 2 cores).

Where no build works (no C++ compiler, no ninja, a compile error) the first try warns
(``RuntimeWarning``), :func:`build_error` says why, and callers run the torch paths.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / f for f in ("ops.cpp", "sparse_mla.cpp", "head.cpp", "indexer.cpp", "elementwise.cpp"))
HEADERS = (CSRC / "common.h", CSRC / "kernels.h")
ISA_FLAGS = {"avx512": ("-march=x86-64-v4",), "avx2": ("-march=x86-64-v3",), "generic": ()}
FLAGS = ("-O3", "-pthread")
ENV_CACHE = "DSV4BATCH_KERNEL_CACHE"
LOCK_TIMEOUT_S = 900  # a build takes ~40 s on 2 busy cores; a lock held longer is given up on

# the CPU features each ISA's -march level may use (/proc/cpuinfo names)
_V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

_lock = threading.Lock()
_state: dict = {}  # isa -> True (loaded) or the reason it could not be (one try per process)


def cache_dir() -> Path:
    """Where builds are kept: ``$DSV4BATCH_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/dsv4batch/kernels``
    (``~/.cache/...``)."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsv4batch" / "kernels"


def _cpu_flags() -> Optional[set]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return None if line is None else set(line.split(":", 1)[1].split())


def runnable_isas() -> list[str]:
    """The ISAs this CPU runs, best first (``generic`` always)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["generic"]
    flags = _cpu_flags()
    if flags is None:  # no /proc/cpuinfo (macOS): torch's own detection
        cap = torch.backends.cpu.get_cpu_capability()
        return {"AVX512": ["avx512", "avx2"], "AVX2": ["avx2"]}.get(cap, []) + ["generic"]
    return [isa for isa, need in (("avx512", _V4), ("avx2", _V3)) if need <= flags] + ["generic"]


def native_isa() -> str:
    """The best ISA this CPU runs (what ``native`` means)."""
    return runnable_isas()[0]


def resolve(isa: str) -> str:
    """``native`` -> `native_isa()`; ValueError for an unknown ISA or one this CPU cannot run."""
    name = native_isa() if isa == "native" else isa
    if name not in ISA_FLAGS:
        raise ValueError(f"ISA must be native or one of {sorted(ISA_FLAGS)}, got {isa!r}")
    if name not in runnable_isas():
        raise ValueError(f"this CPU cannot run {name} code (it runs {runnable_isas()})")
    return name


def _compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CXX", "c++"))


def compiler_version(compiler: str) -> str:
    """`compiler --version`'s output; RuntimeError with its error output where it does not run."""
    try:
        run = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"the C++ compiler {compiler} does not run: {e}") from e
    if run.returncode:
        raise RuntimeError(f"the C++ compiler {compiler} does not run: {(run.stderr or run.stdout).strip()[-300:]}")
    return run.stdout


def build_name(isa: str, compiler: str) -> str:
    """The library's name for these sources, flags, compiler and torch: dsv4batch_<isa>_<key>."""
    version = compiler_version(compiler)
    parts = [*(p.read_bytes() for p in SOURCES + HEADERS), " ".join(FLAGS + ISA_FLAGS[isa]).encode(),
             compiler.encode(), version.encode(), torch.__version__.encode(), platform.machine().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return f"dsv4batch_{isa}_{key}"


def _build(isa: str) -> None:
    """Builds (or finds) and loads `isa`'s library into this process; raises why not."""
    from filelock import FileLock
    from torch.utils import cpp_extension

    compiler = _compiler()
    if compiler is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')} is not on PATH; set $CXX)")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not installed (pip install ninja): torch builds extensions with it")
    name = build_name(isa, compiler)
    folder = cache_dir() / name
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock", timeout=LOCK_TIMEOUT_S):
        (folder / "lock").unlink(missing_ok=True)  # torch's own baton, left behind by a killed build
        cpp_extension.load(name, [str(s) for s in SOURCES], extra_cflags=[*FLAGS, *ISA_FLAGS[isa],
                           f"-DDSV4_ISA={isa}", f"-DDSV4_NS=dsv4batch_{isa}"], build_directory=str(folder),
                           is_python_module=False, verbose=False)


def load(isa: str) -> bool:
    """Whether `isa`'s ops are loaded in this process, building them on the first call (one try
    per process: a failure warns once and is kept, see `build_error`)."""
    with _lock:
        if isa not in _state:
            try:
                _build(isa)
                _state[isa] = True
            except Exception as e:  # noqa: BLE001 - any failure means the torch paths, with the reason
                _state[isa] = f"{type(e).__name__}: {str(e).strip()[-800:]}"
                warnings.warn(f"dsv4batch: the {isa} CPU kernels are not available ({_state[isa]}); the torch "
                              "paths run instead", RuntimeWarning, stacklevel=3)
        return _state[isa] is True


def build_error(isa: str) -> Optional[str]:
    """Why `isa`'s library could not be had in this process (None: loaded, or not tried yet)."""
    state = _state.get(isa)
    return None if state is None or state is True else state
