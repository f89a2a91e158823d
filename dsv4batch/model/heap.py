"""Keep freed memory in the process heap on CPU (glibc), so a step's big temporaries do not
page-fault again in the next step.

glibc serves allocations above its mmap threshold (at most 32 MiB) with fresh `mmap` pages and
returns them on free: every `[T, heads, 512]` attention output, chunk workspace or logits tile
of that size then costs one page fault per 4 KiB on its first write, step after step (measured:
3-11% of a dsv4-shape forward). With mmap off and heap trimming off, freed blocks are reused
instead; the process keeps its peak heap, which is what a scoring actor holds anyway.
A process started with its own glibc malloc settings (`MALLOC_*_` or `GLIBC_TUNABLES`
variables, e.g. to measure live memory by RSS) is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
_done = False


def retain_freed_memory() -> bool:
    """Set glibc's heap to keep freed memory (once per process); False where it cannot
    (not Linux/glibc, or the environment sets malloc itself), and nothing changes then."""
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    if "GLIBC_TUNABLES" in os.environ or any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and friends have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _done = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    return _done
