"""The CPU's C++ kernels, built on first use: sparse attention and the fused vocabulary head.

``csrc/sparse_mla.cpp`` is the ``"cpu"`` backend of :func:`dsv4batch.kernels.sparse_mla_prefill`.
The torch reference (``reference.py``, the definition) runs each block of queries as batched
GEMMs over the *union* of the block's slots: a gathered copy of those K rows, logits for slots a
query does not use, masks and padding. At DSv4's long-context shapes that is 2-5x the useful
work (a ratio-4 layer's 32-query block attends over ~360 rows where each query has 192 slots).
This kernel runs one query at a time over its own valid slots, reading K = V rows straight from
``kv``, with its heads' logits in a small scratch and the output accumulated in registers
(module docstring of the source). Results equal the reference up to fp32 rounding (tests:
``tests/kernels/test_sparse_mla.py``), and a query's bits depend on its own inputs alone.

``csrc/head.cpp`` (:func:`head_stats`) is the fused head: per row, sum 2^z, max z and the
target's z over the whole vocabulary, the GEMM's logits kept in registers (no [n, tile] block
written, read back, exp'd and summed as `model/head.vocab_tiles` does); the weight is kept in
64-column panels (:func:`pack_head`, a second copy of it).

``csrc/indexer.cpp`` (:func:`indexer_topk_cpu`) is the Lightning Indexer's top-k (contract and
definition: ``indexer.py``): one query at a time over its own keys, 48 keys x 8 heads of dot
products in registers, the weighted ReLU sum over heads folded in there, and a running top-k:
no [heads, queries, keys] block, no mask, no full sort.

``csrc/elementwise.cpp`` holds the block's token-wise fp32 passes (their wrappers:
``elementwise.py``).

Build: the C++ compiler named by ``$CXX``, else ``g++``/``c++``/``clang++`` on PATH, with
``FLAGS`` (``-march=native``: the library is for this CPU), into a cache folder keyed by the
source, the flags, the compiler and this CPU's flags: ``$DSV4BATCH_KERNEL_CACHE``, else
``$XDG_CACHE_HOME/dsv4batch/kernels`` (``~/.cache/...``). Concurrent builds (Ray actors) each
write their own temporary file and rename it into place. Where no compiler works, the first
try warns (``RuntimeWarning``), :func:`unsupported_reason` says why, and ``backend="auto"`` runs
the torch reference instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
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
# compiled together into one library
SOURCES = (CSRC / "sparse_mla.cpp", CSRC / "head.cpp", CSRC / "indexer.cpp", CSRC / "elementwise.cpp")
HEADERS = (CSRC / "common.h",)
PANEL = 64  # vocabulary ids per `pack_head` panel (csrc/head.cpp's PW)
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fPIC", "-shared", "-pthread")
ENV_CACHE = "DSV4BATCH_KERNEL_CACHE"
INDEXER_TILE = 48  # keys per tile of csrc/indexer.cpp (KW): zero columns kept past the keys
VECTOR = 16  # floats per vector in the kernel: d_qk and d_v must be multiples of it
BUILD_TIMEOUT_S = 300

_lock = threading.Lock()
_state: dict = {}  # "lib": the loaded library, or "error": why there is none (one try per process)


def cache_dir() -> Path:
    """Where built libraries are kept (see the module docstring)."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsv4batch" / "kernels"


def _compiler() -> Optional[str]:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _cpu_flags() -> str:
    """This CPU's feature list (what -march=native builds for), as /proc/cpuinfo gives it."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def library_path(compiler: str) -> Path:
    """The cached library for these sources, FLAGS, compiler and CPU."""
    key = hashlib.sha256(b"\0".join([*(src.read_bytes() for src in SOURCES + HEADERS), " ".join(FLAGS).encode(),
                                     compiler.encode(), platform.machine().encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    return cache_dir() / f"dsv4batch-cpu-{key}.so"


def _build(path: Path, compiler: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        subprocess.run([compiler, *FLAGS, "-o", str(tmp), *map(str, SOURCES)], check=True, capture_output=True,
                       text=True, timeout=BUILD_TIMEOUT_S)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def library() -> Optional[ctypes.CDLL]:
    """The kernel library, built and loaded on the first call in a process; None where it cannot
    be (then `build_error()` says why; not retried in this process)."""
    with _lock:
        if "lib" not in _state and "error" not in _state:
            try:
                _state["lib"] = _load()
            except subprocess.CalledProcessError as e:
                names = " ".join(s.name for s in SOURCES)
                _state["error"] = f"compiling {names} failed: {(e.stderr or '').strip()[-500:]}"
            except (OSError, subprocess.TimeoutExpired, RuntimeError) as e:
                _state["error"] = f"{type(e).__name__}: {e}"
            if "error" in _state:
                warnings.warn(f"dsv4batch: the CPU kernels are not available ({_state['error']}); attention "
                              "and the head run on the slower torch paths", RuntimeWarning, stacklevel=2)
        return _state.get("lib")


def build_error() -> Optional[str]:
    """Why the library could not be had in this process (None: it loaded, or was not asked for yet)."""
    return _state.get("error")


def _load() -> ctypes.CDLL:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler ($CXX, g++, c++ or clang++ on PATH)")
    path = library_path(compiler)
    if not path.exists():
        _build(path, compiler)
    lib = ctypes.CDLL(str(path))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.sparse_mla_fwd.argtypes = [ptr] * 8 + [i64] * 6 + [ctypes.c_float, ctypes.c_int]
    lib.sparse_mla_fwd.restype = ctypes.c_int
    lib.head_stats.argtypes = [ptr, ptr] + [i64] * 3 + [ptr] * 4 + [ctypes.c_int]
    lib.head_stats.restype = ctypes.c_int
    lib.indexer_topk.argtypes = [ptr] * 5 + [i64] * 5 + [ptr, ctypes.c_int]
    lib.indexer_topk.restype = ctypes.c_int
    lib.rope_inplace.argtypes = [ptr] * 3 + [i64] * 4 + [ctypes.c_int]
    lib.hc_collapse_fwd.argtypes = [ptr] * 3 + [i64] * 3 + [ctypes.c_int]
    lib.hc_post_fwd.argtypes = [ptr] * 5 + [i64] * 3 + [ctypes.c_int]
    lib.hc_pre_fwd.argtypes = [ptr] * 4 + [i64] * 4 + [ctypes.c_float] + [ptr] * 3 + [ctypes.c_int]
    lib.rms_norm_fwd.argtypes = [ptr] * 3 + [i64] * 2 + [ctypes.c_float, ctypes.c_int]
    lib.swiglu_fwd.argtypes = [ptr] * 3 + [i64, ctypes.c_float, ctypes.c_int]
    for fn in (lib.rope_inplace, lib.hc_collapse_fwd, lib.hc_post_fwd, lib.hc_pre_fwd, lib.rms_norm_fwd,
               lib.swiglu_fwd):
        fn.restype = ctypes.c_int
    return lib


def unsupported_reason(q: torch.Tensor, d_v: Optional[int] = None) -> Optional[str]:
    """Why this backend cannot run a call with q [s_q, h_q, d_qk] (and d_v), or None if it can.
    Builds the library on the first call that could use it."""
    if q.device.type != "cpu":
        return f"q is on {q.device}; the cpu kernel runs on the CPU"
    if q.dtype == torch.float64:
        return "q is float64: the torch reference computes in float64, the cpu kernel in float32"
    d_qk = q.shape[-1]
    d_v = d_qk if d_v is None else int(d_v)
    if d_qk % VECTOR or d_v % VECTOR:
        return f"d_qk={d_qk}, d_v={d_v}: the cpu kernel needs multiples of {VECTOR}"
    if library() is None:
        return f"the cpu kernel could not be built ({build_error()})"
    return None


@torch.no_grad()
def sparse_mla_prefill_cpu(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                           attn_sink: Optional[torch.Tensor] = None, topk_length: Optional[torch.Tensor] = None,
                           d_v: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shapes, dtypes and edge cases: ``dsv4batch.kernels.sparse_mla_prefill`` (checked by the
    caller, with `unsupported_reason` None). fp32 math whatever q's dtype; out in q's dtype."""
    s_q, h_q, d_qk = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    d_v = d_qk if d_v is None else int(d_v)
    out = torch.empty(s_q, h_q, d_v, dtype=torch.float32)  # the kernel writes every element
    max_logits = torch.empty(s_q, h_q, dtype=torch.float32)
    lse = torch.empty(s_q, h_q, dtype=torch.float32)
    if not (s_q and topk and s_kv):  # every query lonely
        out.zero_(), max_logits.fill_(-math.inf), lse.fill_(math.inf)
    else:
        qf = q.contiguous().float()
        kvf = kv.reshape(s_kv, d_qk).contiguous().float()
        # int32 for the kernel; wider values clamped first so that no invalid index wraps into range
        idx = indices.reshape(s_q, topk)
        idx = (idx if idx.dtype == torch.int32 else idx.clamp(-1, s_kv).to(torch.int32)).contiguous()
        lens = None if topk_length is None else topk_length.reshape(s_q).clamp(-1, topk).to(torch.int32).contiguous()
        sink = None if attn_sink is None else attn_sink.reshape(h_q).float().contiguous()
        library().sparse_mla_fwd(qf.data_ptr(), kvf.data_ptr(), idx.data_ptr(),
                                 None if lens is None else lens.data_ptr(), None if sink is None else sink.data_ptr(),
                                 out.data_ptr(), max_logits.data_ptr(), lse.data_ptr(), s_q, h_q, d_qk, d_v,
                                 s_kv, topk, float(sm_scale), torch.get_num_threads())
    return out.to(q.dtype), max_logits, lse


def head_supported(weight: torch.Tensor) -> bool:
    """Whether `head_stats` can run a head of this weight [V, K]: fp32 on the CPU, no grad, and
    the library built (building it on the first call)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and not (weight.requires_grad and torch.is_grad_enabled()) and library() is not None)


@torch.no_grad()
def pack_head(weight: torch.Tensor) -> torch.Tensor:
    """weight [V, K] fp32 -> panels [ceil(V / 64), K, 64]: panel p, row k holds weight[64p:64p + 64, k]
    (ids past V zero; `head_stats` ignores them)."""
    num, k = -(-weight.shape[0] // PANEL), weight.shape[1]
    padded = torch.zeros(num * PANEL, k, dtype=torch.float32)
    padded[:weight.shape[0]] = weight
    return padded.view(num, PANEL, k).transpose(1, 2).contiguous()


@torch.no_grad()
def head_stats(xs: torch.Tensor, panels: torch.Tensor, vocab: int, targets: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """xs [n, K] fp32 (rows times log2 e), panels = `pack_head(weight)` with weight [vocab, K],
    targets [n] int -> (sums [n]: sum over ids of 2^z, z = xs . weight[id]; peaks [n]: max z;
    picked [n]: z at the target, 0 where it is not in [0, vocab)), all fp32. sums is inf when a
    z passes 127 and misses terms below z = -126 (callers redo rows outside [2^-100, inf))."""
    n, k = xs.shape
    if panels.shape != (-(-vocab // PANEL), k, PANEL) or panels.dtype != torch.float32:
        raise ValueError(f"panels {tuple(panels.shape)} {panels.dtype} are not pack_head of a [{vocab}, {k}] "
                         "fp32 weight")
    xs, tg = xs.contiguous().float(), targets.reshape(n).to(torch.int64).contiguous()
    sums, peaks, picked = torch.empty(n), torch.empty(n), torch.zeros(n)
    if n:
        library().head_stats(xs.data_ptr(), panels.data_ptr(), n, k, vocab, tg.data_ptr(), sums.data_ptr(),
                             peaks.data_ptr(), picked.data_ptr(), torch.get_num_threads())
    return sums, peaks, picked


def indexer_supported(q: torch.Tensor) -> bool:
    """Whether `indexer_topk_cpu` can run for queries q: on the CPU, and the library built."""
    return q.device.type == "cpu" and library() is not None


@torch.no_grad()
def indexer_topk_cpu(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, key_lo: torch.Tensor,
                     visible: torch.Tensor, width: int) -> torch.Tensor:
    """The indexer's top-k (shapes and meaning: ``dsv4batch/kernels/indexer.py``) -> picks
    [s, width] int64. ValueError where a query's keys run past ``keys``."""
    s, h, d = q.shape
    e = keys.shape[0]
    lo = key_lo.reshape(s).to(torch.int64).contiguous()
    n = visible.reshape(s).to(torch.int64).clamp(min=0).contiguous()
    if s and (int(lo.min()) < 0 or int((lo + n).max()) > e):
        raise ValueError(f"indexer queries see keys outside keys [{e}, {d}]")
    out = torch.empty(s, width, dtype=torch.int64)
    if s and width:
        # the keys transposed ([d, e] rows of 48-key vectors), with a zero tile past the last key
        kt = torch.zeros(d, e + INDEXER_TILE, dtype=torch.float32)
        kt[:, :e] = keys.t()
        qf, wf = q.contiguous().float(), w.reshape(s, h).contiguous().float()
        library().indexer_topk(qf.data_ptr(), wf.data_ptr(), kt.data_ptr(), lo.data_ptr(), n.data_ptr(), s, h, d,
                               kt.shape[1], width, out.data_ptr(), torch.get_num_threads())
    return out
