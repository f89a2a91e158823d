"""Where the engine's time goes: torch.profiler per-op and per-layer tables, plus two speed checks.

`python -m dsv4batch.bench profile --json` profiles one `Engine.score` call per model and case
and prints (1) the top ops by self CPU time and (2) labelled regions: per layer its attention,
compressor(s), indexer queries / top-k and MoE, and step-wide ones (step context = layouts and
plans, carry = carried-state concatenation, kernel = `sparse_mla_prefill`, hc = mHC, head). Region
times are inclusive wall times of the range (nested regions overlap their parent).

Cases: `mixedN` = N short requests (16-255 tokens, seeded), `singleN` = one N-token request.
`--compare`: engine vs transformers on the same cases (end to end and decoder stack only,
interleaved, best of `--repeats`; reuses `bench.forward`'s pair and timing helpers; transformers in
its own process unless `--hf-shared`).
`--scaling 1024,4096,...`: one request per length, microseconds per token (end to end), the
indexer's share and the peak resident memory of the call (VmHWM after resetting it).
`--gemm`: this machine's fp32 GEMM rate next to the head's achieved rate (same run, CPU time);
with `--compare` also each case's `ceiling_speedup`: the end-to-end ratio our decoder stack
would reach with the head's GEMM at that rate, and `floor_speedup`: the ratio with every GEMM
(the stack's counted mm/bmm FLOPs, `stack_gflop`, and the head's) at that rate (`add_ceilings`).
`--kernels`: the C++ CPU kernels on each case, in one process, end to end, interleaved, best of
`--repeats` (`kernels_case`): `tiled` = torch attention (`attn_backend="torch"`) and the tiled
head (`KernelConfig.gemm="onednn"`), the engine before these kernels; `attn` = the fused cpu
attention kernel and the tiled head; `fused` = both C++ kernels (the default): tokens/s,
speedups over `tiled` and the logprobs' absolute difference from it (`bench/variants.py`).
`--attn-backend`: our engine's `EngineConfig.attn_backend` for every other measurement.
`--isa`: the C++ kernels' build for the whole run (`native`: the best this CPU runs; `avx2`
reproduces an AVX2 machine's kernels on an AVX-512 one); every result names the CPU and the ISA.
`--bf16`: fp32 vs the same model cast to bfloat16 (CPU AMX / AVX512-BF16 GEMMs accumulate in
fp32) and vs the fp32 model with a bf16 head (`head_precision="bf16"`) on each case: tokens/s and
the logprobs' absolute difference from fp32 (max, mean). `--head-precision bf16`: every other
measurement with the bf16 head.
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import numpy as np
import torch

from bench.common import best_of, emit, machine, random_prompts
from bench.variants import bf16_case, kernels_case

TYPE = {1: "swa", 4: "c4", 128: "c128"}


def case_lengths(name: str) -> list[int]:
    """`mixed32` -> 32 seeded short lengths in [16, 256); `single2048` -> [2048]."""
    if name.startswith("mixed"):
        return np.random.default_rng(int(name[5:])).integers(16, 256, size=int(name[5:])).tolist()
    if name.startswith("single"):
        return [int(name[6:])]
    raise ValueError(f"unknown case {name!r} (mixedN or singleN)")


def build_engine(model_name: str, config):
    """Our engine alone (no transformers twin): `tiny` or a seeded bench model (`dsv4-shape`, `unseen`)."""
    from dsv4batch.model import TINY, Engine

    if model_name == TINY:
        return Engine.from_pretrained(TINY, config=config)
    from bench.forward import seeded_model

    return Engine(seeded_model(model_name), config)


class Regions:
    """Wraps callables so each call runs inside `record_function(label)` and adds to `seconds`."""

    def __init__(self):
        self.seconds, self.calls, self._undo = {}, {}, []

    def wrap(self, owner, attr: str, label: str):
        if not hasattr(owner, attr):
            return
        fn, had_own = getattr(owner, attr), attr in vars(owner)
        regions = self

        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            with torch.profiler.record_function(label):
                out = fn(*args, **kwargs)
            regions.seconds[label] = regions.seconds.get(label, 0.0) + time.perf_counter() - t0
            regions.calls[label] = regions.calls.get(label, 0) + 1
            return out

        setattr(owner, attr, wrapped)
        self._undo.append((owner, attr, fn if had_own else None))

    def restore(self):
        for owner, attr, fn in reversed(self._undo):
            if fn is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, fn)
        self._undo.clear()


@contextmanager
def annotated(engine):
    """Install every region of `engine`'s model (and step/kernel helpers); undone on exit."""
    import dsv4batch.model.attention as attention
    import dsv4batch.model.engine as engine_mod
    import dsv4batch.model.model as model_mod
    import dsv4batch.model.step as step

    regions, model = Regions(), engine.model
    regions.wrap(engine_mod, "StepContext", "step.context")
    for name in ("cache_in", "carry", "carry_entries", "store"):
        regions.wrap(step.StepContext, name, "step.carry")
    regions.wrap(attention, "sparse_mla_prefill", "kernel")
    regions.wrap(model_mod, "hc_pre", "hc")
    regions.wrap(model_mod, "hc_post", "hc")
    regions.wrap(model, "token_logprobs", "head")
    for i, layer in enumerate(model.layers):
        tag = f"L{i}.{TYPE.get(layer.ratio, layer.ratio)}"
        attn = layer.attn
        regions.wrap(attn, "forward", f"{tag}.attn")
        regions.wrap(layer.ffn, "forward", f"{tag}.moe")
        if attn.compressor is not None:
            regions.wrap(attn.compressor, "forward", f"{tag}.compressor")
        if attn.indexer is not None:
            regions.wrap(attn.indexer.compressor, "forward", f"{tag}.indexer.compressor")
            regions.wrap(attn.indexer, "queries", f"{tag}.indexer.queries")
            regions.wrap(attn, "sparse_indices", f"{tag}.indexer.topk")
    try:
        yield regions
    finally:
        regions.restore()


def profile_case(engine, batch, rows: int, repeats: int) -> dict:
    """`repeats` profiled `score(batch)` calls after a warm-up, the least disturbed one kept
    (shortest wall time): top ops, regions, per-layer summary."""
    engine.score(batch)
    wall = best_of(lambda: engine.score(batch), repeats)
    best = None
    for _ in range(repeats):
        with annotated(engine) as regions:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                engine.score(batch)
                profiled = time.perf_counter() - t0
        if best is None or profiled < best[0]:
            best = (profiled, prof.key_averages(), dict(regions.seconds), dict(regions.calls))
    profiled, events, seconds, calls = best
    ops = sorted((e for e in events if e.key not in seconds), key=lambda e: -e.self_cpu_time_total)
    op_total = sum(e.self_cpu_time_total for e in ops) / 1e6
    table = [{"op": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 1),
              "share": round(e.self_cpu_time_total / 1e6 / profiled, 4)} for e in ops[:rows]]
    regs = {k: {"calls": calls[k], "ms": round(1e3 * v, 1), "share": round(v / profiled, 4)}
            for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}
    layers = {}
    for label, secs in seconds.items():
        if label.startswith("L"):
            layer, part = label.split(".", 2)[:2], label.split(".", 2)[2]
            layers.setdefault(".".join(layer), {})[part] = round(1e3 * secs, 1)
    return {"tokens": sum(len(ids) - 1 for ids in batch), "wall_s": round(wall, 4),
            "profiled_wall_s": round(profiled, 4), "op_self_s": round(op_total, 4),
            "outside_ops_share": round(1 - op_total / profiled, 4), "ops": table, "regions": regs,
            "layers": dict(sorted(layers.items(), key=lambda kv: int(kv[0].split(".")[0][1:])))}


def compare_case(ours, hf, batch, repeats: int) -> dict:
    """Engine vs transformers on one batch, end to end and decoder stack only (bench.forward's way)."""
    from bench.forward import ours_layers

    tokens = sum(len(ids) - 1 for ids in batch)
    ours.score(batch)
    t = {k: float("inf") for k in ("ours", "hf", "ours_layers", "hf_layers")}
    for _ in range(repeats):
        t["ours"] = min(t["ours"], best_of(lambda: ours.score(batch), 1))
        t["hf"] = min(t["hf"], hf.seconds(batch))
        t["ours_layers"] = min(t["ours_layers"], best_of(lambda: ours_layers(ours, batch), 1))
        t["hf_layers"] = min(t["hf_layers"], hf.seconds(batch, head=False))
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as flops:  # the stack's GEMM work (mm/bmm) as our kernels run it
        ours_layers(ours, batch)
    return {"requests": len(batch), "tokens": tokens, "ours_tok_s": round(tokens / t["ours"], 1),
            "hf_tok_s": round(tokens / t["hf"], 1), "speedup": round(t["hf"] / t["ours"], 2),
            "stack_gflop": round(flops.get_total_flops() / 1e9, 2),
            "ours_layers_tok_s": round(tokens / t["ours_layers"], 1),
            "hf_layers_tok_s": round(tokens / t["hf_layers"], 1),
            "layers_speedup": round(t["hf_layers"] / t["ours_layers"], 2)}


def rss_mib(field: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def scaling(engine, lengths, repeats: int) -> dict:
    """Per-token cost and peak memory of one request per length (end to end, head included).

    peak_rss_mib: the process's peak resident memory over the warm-up and timed calls (VmHWM
    reset before them; the engine keeps freed heap memory, so with ascending lengths this is
    the peak of the longest request so far; the weights are in it).

    Best of `repeats` by process CPU time (on a shared machine the least disturbed run; the wall
    time of that run is reported next to it). Shares are of that run's wall time."""
    rows = {}
    for n in lengths:
        batch = random_prompts([n], engine.model.config.vocab_size, seed=n)
        with open("/proc/self/clear_refs", "w") as fh:  # resets VmHWM (peak RSS) to the current RSS
            fh.write("5")
        engine.score(batch)
        best = None
        for _ in range(repeats):
            with annotated(engine) as regions:
                w0, c0 = time.perf_counter(), time.process_time()
                stats = engine.score(batch)[1]
                wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            if best is None or cpu < best[1]:
                best = (wall, cpu, dict(regions.seconds), stats)
        wall, cpu, secs, stats = best
        rows[str(n)] = {"us_per_token": round(1e6 * cpu / (n - 1), 1),
                        "wall_us_per_token": round(1e6 * wall / (n - 1), 1),
                        "indexer_share": round(sum(v for k, v in secs.items() if ".indexer." in k) / wall, 4),
                        "kernel_share": round(secs.get("kernel", 0.0) / wall, 4),
                        "head_share": round(secs.get("head", 0.0) / wall, 4),
                        "steps": stats.num_steps, "peak_rss_mib": round(rss_mib("VmHWM"), 1),
                        "peak_workspace_mib": round(stats.peak_workspace_bytes / 2**20, 2)}
    first = rows[str(lengths[0])]["us_per_token"]
    for row in rows.values():
        row["vs_first"] = round(row["us_per_token"] / first, 3)
    return rows


def cpu_best(fn, repeats: int) -> float:
    """Least process CPU time of `repeats` calls after one warm-up (time the machine ran us)."""
    fn()
    return best_of(fn, repeats, clock=time.process_time)


def gemm_rates(engine, repeats: int) -> dict:
    """fp32 GFLOP/s of a 2048^3 GEMM through BLAS (`torch.mm`) and through `kernels.dense_linear`
    (oneDNN where it runs), of the head's GEMM tiles alone ([rows, hidden] x [hidden, VOCAB_TILE]
    over the vocabulary, as the tiled head runs them: on its packed tiles) and of the head as
    `score` runs it (`token_logprobs` on 4 slices' rows: the fused C++ head on the CPU in fp32,
    `kernels.head_stats`; else the tiles); CPU time, best of `repeats + 2`. Fractions: fused head / the
    faster 2048^3 rate (this machine's fp32 GEMM rate) and / the tile rate. With
    `--head-precision bf16` the tiles and the head are bf16 GEMMs (`kernels.bf16_linear`), still
    divided by the fp32 rate."""
    from dsv4batch.kernels import bf16_linear, dense_linear
    from dsv4batch.model.head import VOCAB_TILE

    model, reps = engine.model, repeats + 2
    hidden, vocab, rows = model.config.hidden_size, model.config.vocab_size, engine.config.logits_slice
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    blas = 2 * 2048 ** 3 / cpu_best(lambda: torch.mm(a, b.t()), reps)
    dense = 2 * 2048 ** 3 / cpu_best(lambda: dense_linear(a, b), reps)
    square = max(blas, dense)
    h, w = torch.randn(rows * 4, hidden), model.head.weight.detach()
    targets = torch.randint(0, vocab, (rows * 4,))

    with torch.inference_mode():
        packed = model.packed_head.tiles(w, VOCAB_TILE, rows, engine.config.head_precision)
        weights = [None] * -(-vocab // VOCAB_TILE) if packed is None else packed.weights
        is_bf16 = packed is not None and packed.is_bf16

        def tiles():
            x = h[:rows].bfloat16() if is_bf16 else h[:rows]
            for i, v0 in enumerate(range(0, vocab, VOCAB_TILE)):
                bf16_linear(x, weights[i]) if is_bf16 else dense_linear(x, w[v0:v0 + VOCAB_TILE], weights[i])

        tile = 2 * rows * hidden * vocab / cpu_best(tiles, reps)
        head = 2 * h.shape[0] * hidden * vocab / cpu_best(
            lambda: model.token_logprobs(h, targets, rows, engine.config.head_precision), reps)
    return {"gemm_2048_blas_gflops": round(blas / 1e9, 1), "gemm_2048_dense_linear_gflops": round(dense / 1e9, 1),
            "head_tile_gemm_gflops": round(tile / 1e9, 1), "head_gflops": round(head / 1e9, 1),
            "head_fraction_of_gemm_2048": round(head / square, 3), "head_fraction_of_tile_gemm": round(head / tile, 3)}


def add_ceilings(out: dict, config) -> None:
    """Per compared case, what the fp32 head allows: `head_floor_s` = the head's GEMM FLOPs
    (2 * tokens * hidden * vocab) at this run's fp32 2048^3 rate on every thread, and
    `ceiling_speedup` = transformers' time / (our decoder stack's time + head_floor_s): the
    end-to-end ratio if our head ran at the machine's GEMM rate with nothing else around it; and
    `floor_speedup` = transformers' time / ((stack_gflop + the head's GFLOP) at that rate): the
    ratio if every GEMM we run, stack included, ran at the machine's rate and nothing else took time."""
    gemm = out["gemm"]
    rate = max(gemm["gemm_2048_blas_gflops"], gemm["gemm_2048_dense_linear_gflops"]) * 1e9 * torch.get_num_threads()
    for row in out.values():
        if "speedup" not in row:
            continue
        tokens = row["tokens"]
        floor = 2 * tokens * config.hidden_size * config.vocab_size / rate
        row["head_floor_s"] = round(floor, 4)
        row["ceiling_speedup"] = round((tokens / row["hf_tok_s"]) / (tokens / row["ours_layers_tok_s"] + floor), 2)
        row["floor_speedup"] = round((tokens / row["hf_tok_s"]) / (floor + row["stack_gflop"] * 1e9 / rate), 2)


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m dsv4batch.bench profile")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--models", default="tiny,dsv4-shape")
    parser.add_argument("--cases", default="mixed16,mixed32,single2048")
    parser.add_argument("--rows", type=int, default=15, help="top ops listed per case")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compare", action="store_true", help="engine vs transformers instead of profiles")
    parser.add_argument("--hf-shared", action="store_true", help="with --compare: transformers in this "
                        "process (sharing our engine's glibc heap settings), not its own")
    parser.add_argument("--scaling", default="", help="lengths for the per-token table, e.g. 1024,4096")
    parser.add_argument("--gemm", action="store_true", help="measure GEMM rates and the head's fraction")
    parser.add_argument("--bf16", action="store_true", help="fp32 vs a bfloat16 model and vs a bf16 head: "
                        "speed and logprob error")
    parser.add_argument("--head-precision", default="fp32", help="our engine's EngineConfig.head_precision")
    parser.add_argument("--kernels", action="store_true", help="the engine without / with the C++ CPU kernels "
                        "(attention, head): speed and logprob difference")
    parser.add_argument("--attn-backend", default="auto", help="our engine's EngineConfig.attn_backend")
    parser.add_argument("--isa", default="native", help="the C++ kernels' build: native (the best this CPU "
                        "runs), avx512, avx2 (-march=x86-64-v3, as on any AVX2 machine) or generic")
    args = parser.parse_args(argv)
    from dsv4batch.model import EngineConfig

    max_len = max([16384] + [int(n) for n in args.scaling.split(",") if n])
    config = EngineConfig(max_num_batched_tokens=4096, max_model_len=max_len, head_precision=args.head_precision,
                          attn_backend=args.attn_backend)
    result = {"bench": "profile", **machine(args.isa), "threads": torch.get_num_threads(), "models": {}}
    for model_name in args.models.split(","):
        out = result["models"].setdefault(model_name, {})
        if args.compare:
            from bench.forward import build_pair

            ours, hf = build_pair(model_name, config, args.hf_shared)
        else:
            ours, hf = build_engine(model_name, config), None
        for case in args.cases.split(",") if args.cases else []:
            batch = random_prompts(case_lengths(case), ours.model.config.vocab_size, seed=len(case))
            if args.kernels:
                out[case] = kernels_case(ours, batch, args.repeats)
            elif args.bf16:
                out[case] = bf16_case(ours, batch, args.repeats)
            else:
                out[case] = compare_case(ours, hf, batch, args.repeats) if args.compare \
                    else profile_case(ours, batch, args.rows, args.repeats)
        if args.scaling:
            out["scaling"] = scaling(ours, [int(n) for n in args.scaling.split(",")], args.repeats)
        if args.gemm:
            out["gemm"] = gemm_rates(ours, args.repeats)
            if args.compare:
                add_ceilings(out, ours.model.config)
        if hf is not None:
            hf.close()
        del ours, hf
    emit(result, args.json)
