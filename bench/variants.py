"""The same model with other kernels or precisions, in one process (`profile --kernels`,
`--bf16`): speed and the logprobs' difference from the baseline variant."""

from __future__ import annotations

import time

import numpy as np
import torch

from bench.common import best_of


# name: (attn_backend, KernelConfig.gemm, KernelConfig.elementwise). tiled: round six's torch paths
# (torch attention and indexer, the oneDNN-tiled head); attn: + the attention and indexer kernels;
# fused: + the fused head; all (the default engine): + the token-wise C++ passes
KERNEL_VARIANTS = {"tiled": ("torch", "onednn", "torch"), "attn": ("cpu", "onednn", "torch"),
                   "fused": ("cpu", "fused", "torch"), "all": ("cpu", "fused", "auto")}


def kernels_case(ours, batch, repeats: int) -> dict:
    """`KERNEL_VARIANTS` of one engine's model on one batch:
    tok/s of each (interleaved, best of `repeats`), speedups over "tiled", |logprob difference|."""
    import dataclasses

    from dsv4batch.kernels import use_kernels
    from dsv4batch.model import Engine

    def run(name):
        attn, gemm, elementwise = KERNEL_VARIANTS[name]
        with use_kernels(gemm=gemm, elementwise=elementwise):  # the engine keeps them (Engine.kernels)
            engine = Engine(ours.model, dataclasses.replace(ours.config, attn_backend=attn))
        t0 = time.perf_counter()
        out = engine.score(batch)[0]
        return time.perf_counter() - t0, np.concatenate(out).astype(np.float64)

    scores = {k: run(k)[1] for k in KERNEL_VARIANTS}  # warm-up (packs each head copy once)
    t = {k: float("inf") for k in KERNEL_VARIANTS}
    for _ in range(repeats):
        for k in KERNEL_VARIANTS:
            t[k] = min(t[k], run(k)[0])
    tokens = sum(len(ids) - 1 for ids in batch)
    out = {"tokens": tokens, **{f"{k}_tok_s": round(tokens / t[k], 1) for k in KERNEL_VARIANTS}}
    for k in list(KERNEL_VARIANTS)[1:]:
        diff = np.abs(scores[k] - scores["tiled"])
        out.update({f"{k}_speedup": round(t["tiled"] / t[k], 2), f"{k}_max_abs_diff": float(diff.max()),
                    f"{k}_mean_abs_diff": float(diff.mean())})
    return out


def bf16_case(ours, batch, repeats: int) -> dict:
    """fp32 engine vs a bfloat16 copy of its model, and vs its own model with a bf16 head
    (`head_precision="bf16"`), on one batch: tok/s and logprob error against fp32."""
    import copy
    import dataclasses

    from dsv4batch.model import Engine

    fp32 = Engine(ours.model, dataclasses.replace(ours.config, head_precision="fp32"))
    low = Engine(copy.deepcopy(ours.model).to(torch.bfloat16), fp32.config)
    head = Engine(ours.model, dataclasses.replace(ours.config, head_precision="bf16"))
    engines = {"fp32": fp32, "bf16": low, "head_bf16": head}
    scores = {k: np.concatenate(e.score(batch)[0]).astype(np.float64) for k, e in engines.items()}
    times = {k: best_of(lambda e=e: e.score(batch), repeats) for k, e in engines.items()}
    tokens = sum(len(ids) - 1 for ids in batch)
    out = {"tokens": tokens, "fp32_tok_s": round(tokens / times["fp32"], 1)}
    for k, prefix in (("bf16", ""), ("head_bf16", "head_bf16_")):
        diff = np.abs(scores["fp32"] - scores[k])
        out.update({f"{k}_tok_s": round(tokens / times[k], 1), f"{k}_speedup": round(times["fp32"] / times[k], 2),
                    f"{prefix}max_abs_diff": round(float(diff.max()), 4),
                    f"{prefix}mean_abs_diff": round(float(diff.mean()), 5)})
    return out
