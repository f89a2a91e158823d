"""Tensor-parallel replicas on this machine, and per-rank weight bytes of the real models on paper.

Measured (one run, ratios inside it): tokens/s of the same batch scored by 1 replica x T=2 (two
rank workers, one gloo all-reduce per attention and MoE, one small all-gather per head slice), by
2 replicas x T=1 (the batch split in two, both replicas at once) and by 1 x 1; every rank is a Ray
actor with one torch thread (`ShardedEngine`, the path `--tp` takes). Reported with each rank's
resident bytes and the share of rank 0's step time spent in collectives.

On paper (meta device, nothing allocated): each rank's resident weight bytes for V4-Flash and
V4-Pro at T = 1, 2, 4, 8, as `--tp T` holds them: the rank's `DSv4Model` (its heads, groups,
expert block, vocabulary slice) with FP8 linears and FP4 experts as stored, the rest bf16;
next to `capacity.plan_capacity`'s arithmetic for the same T.

    python -m dsv4batch.bench shards --json [--requests 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import threading
import time

from bench.common import emit, random_prompts


def on_paper(tp_choices=(1, 2, 4, 8)) -> dict:
    import torch
    from transformers import DeepseekV4Config

    from dsv4batch.model.capacity import plan_capacity, weight_bytes
    from dsv4batch.model.layers import Experts, Linear
    from dsv4batch.model.loader import KEEP_FP32, meta_model
    from dsv4batch.model.model import model_tensors
    from dsv4batch.model.parallel import TP
    from dsv4batch.model.quant import NATIVE_FP8, StoredFormat, hold_stored
    from tests.model.test_quant_layout import FLASH, PRO  # the reference's config tables

    def held_bytes(model) -> dict[str, int]:  # as a bf16 load holds it: fp32 only where DSv4 keeps it
        return {n: p.numel() * (p.element_size() if p.dtype != torch.float32 or KEEP_FP32.search(n) else 2)
                for n, p in model_tensors(model).items()}

    fp8 = StoredFormat("fp8", torch.float8_e4m3fn, torch.float8_e8m0fnu)
    fp4 = StoredFormat("fp4", torch.int8, torch.float8_e8m0fnu)
    out = {}
    for label, raw in (("V4-Flash", FLASH), ("V4-Pro", PRO)):
        config = DeepseekV4Config.from_dict(raw)
        whole = meta_model(config)
        formats = {}
        for name, module in whole.named_modules():
            if isinstance(module, Linear) and NATIVE_FP8.search(name + ".weight"):
                formats[name] = fp8
            elif isinstance(module, Experts):
                formats.update({f"{name}.{w}": fp4 for w in ("w1", "w2", "w3")})
        rows = {}
        for t in tp_choices:
            model = meta_model(config, TP(0, t))
            hold_stored(model, formats)
            rows[t] = sum(held_bytes(model).values())
        hold_stored(whole, formats)
        full = held_bytes(whole)
        split = weight_bytes(full)
        plan = plan_capacity(config, full, gpu_memory_bytes=141 * 2**30, max_model_len=65536,
                             max_batched_tokens=8192)
        out[label] = {"rank_weight_gib": {t: round(b / 2**30, 2) for t, b in rows.items()},
                      "plan_rank_weight_gib": {r["tp"]: round(r["weight_bytes"] / 2**30, 2) for r in plan["ranks"]},
                      "replicated_gib": round(split["replicated"] / 2**30, 2),
                      "split_gib": round(split["split_total"] / 2**30, 2)}
    return out


def measure(num_requests: int, repeats: int) -> dict:
    import ray

    import numpy as np

    from dsv4batch.actors.shards import ShardedEngine
    from dsv4batch.jobspec.config import ScoreConfig

    rng = np.random.default_rng(0)
    lengths = rng.integers(64, 512, num_requests).tolist()
    batch = random_prompts(lengths, 129280, seed=1)
    tokens = sum(lengths)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    config = ScoreConfig(torch_threads=1, max_batched_tokens=2048)

    def engines(replicas, tp):
        return [ShardedEngine(config.replace(tp=tp), 0.0, 1.0 / (replicas * tp)) for _ in range(replicas)]

    def run(group):
        halves = [batch[i::len(group)] for i in range(len(group))]
        stats = [None] * len(group)

        def one(i):
            stats[i] = group[i].score_details(halves[i])[1]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(group))]
        t0 = time.perf_counter()
        [t.start() for t in threads]
        [t.join() for t in threads]
        return time.perf_counter() - t0, stats

    layouts = {"1x1": (1, 1), "2x1": (2, 1), "1x2": (1, 2)}
    result = {"requests": num_requests, "tokens": tokens, "torch_threads_per_rank": 1}
    for label, (replicas, tp) in layouts.items():
        group = engines(replicas, tp)
        try:
            run(group)  # warm-up
            best, stats = min((run(group) for _ in range(repeats)), key=lambda r: r[0])
            forward = sum(s.forward_s for s in stats)
            result[label] = {"replicas": replicas, "tp": tp, "seconds": round(best, 3),
                             "tokens_per_s": round(tokens / best, 1),
                             "collective_share": round(sum(s.collective_s for s in stats) / forward, 4),
                             "rank_resident_mib": [round(r["resident_bytes"] / 2**20, 1)
                                                   for e in group for r in e.ranks]}
        finally:
            for e in group:
                e.close()
    base = result["1x1"]["tokens_per_s"]
    for label in layouts:
        result[label]["vs_1x1"] = round(result[label]["tokens_per_s"] / base, 3)
    ray.shutdown()
    return result


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m dsv4batch.bench shards")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paper-only", action="store_true", help="skip the measured part")
    args = parser.parse_args(argv)
    result = {"on_paper": on_paper()}
    if not args.paper_only:
        result["measured"] = measure(args.requests, args.repeats)
    emit(result, args.json)
