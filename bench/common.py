"""Shared benchmark helpers: timing, prompts, and our model exported for transformers."""

from __future__ import annotations

import json
import time

import numpy as np


def best_of(fn, repeats: int, clock=time.perf_counter) -> float:
    """Best time of `repeats` calls by `clock` (wall by default; `time.process_time` for CPU
    time): the machines are shared, the minimum is the least noisy."""
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def random_prompts(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[0] + rng.integers(3, vocab, size=n - 1).tolist() for n in lengths]


def machine(isa: str = "native") -> dict:
    """{"cpu": the CPU model, "isa": the C++ kernels' ISA} after running `isa`'s kernels from now on
    (`kernels.cpu.use_isa`): what every bench result is headed by."""
    from dsv4batch.kernels import cpu, select

    return {"cpu": select.cpu_model(), "isa": cpu.use_isa(isa)}


def emit(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2))
        return
    for key, value in result.items():
        print(f"{key}: {value}")
