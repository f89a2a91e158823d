"""`dsv4batch plan`: how many GPUs one replica needs, before any GPU is taken.

    dsv4batch plan --model /fsx/DeepSeek-V4-Flash --gpu-memory-gib 141 [--tp T] \\
        [--max-model-len N] [--max-batched-tokens N] [--json]

Reads config.json and the safetensors headers (a `meta` model; of the tensor data only the small
hash-routing tables, checked like `dsv4batch score` checks the folder before Ray starts), prints the
per-rank weight bytes, the planner's workspace reservation, one step's activations and the
smallest tensor-parallel size that fits (`dsv4batch.model.capacity`). Every number is checked
(`cli.PLAN_LIMITS`: finite, in range) with a one-line error. Exit codes: 0 it fits (with `--tp`:
that size fits), 1 it does not, 2 bad arguments or a model folder that would not load.
"""

from __future__ import annotations

import json
import sys

from dsv4batch.model.capacity import GIB, model_tensor_bytes, plan_capacity

SPLIT_NAMES = {"heads": "wq_b/attn_sink by heads", "groups": "wo_a by groups", "row_parallel": "wo_b row-parallel",
               "experts": "routed experts", "shared_expert": "shared expert", "vocab": "embed/head by vocab"}


def make_plan(args) -> dict:
    """The plan for parsed `dsv4batch plan` arguments (the model's plan plus the inputs)."""
    config, sizes, stored = model_tensor_bytes(args.model, args.dtype, args.weights)
    kw = dict(gpu_memory_bytes=int(args.gpu_memory_gib * GIB), max_model_len=args.max_model_len,
              max_batched_tokens=args.max_batched_tokens, dtype=args.dtype,
              prefill_chunk_size=args.prefill_chunk_size, gpu_memory_utilization=args.gpu_memory_utilization)
    plan = plan_capacity(config, sizes, **kw)
    if args.tp:
        plan["requested"] = plan_capacity(config, sizes, tp=args.tp, **kw)["ranks"][0]
    return {"model": args.model, "weights_mode": args.weights, **stored, **plan}


def gib(n: int) -> str:
    """Bytes for people: GiB from 1 GiB up, else MiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def render(plan: dict) -> str:
    """The plan as text: the model's bytes, then one line per tensor-parallel size."""
    w, ws = plan["weights"], plan["workspace"]
    lines = [f"capacity plan: {plan['model']} ({plan['dtype']}, weights {plan['weights_mode']})"]
    if plan["checkpoint_bytes"]:
        lines.append(f"checkpoint: {gib(plan['checkpoint_bytes'])} of tensors "
                     f"({gib(plan['ignored_bytes'])} of mtp.* not loaded)")
    split = ", ".join(f"{SPLIT_NAMES[k]} {gib(v)}" for k, v in sorted(w["split"].items(), key=lambda kv: -kv[1]))
    lines += [f"weights held: {gib(w['total'])} = replicated {gib(w['replicated'])} + split {gib(w['split_total'])}"
              f" ({split})",
              f"workspace (prefill_chunk_size {plan['prefill_chunk_size']}, max_model_len {plan['max_model_len']}, "
              f"max_batched_tokens {plan['max_batched_tokens']}): "
              + ", ".join(f"ratio {r} {gib(b)}" for r, b in ws["by_ratio"].items())
              + f" -> {gib(ws['reserved'])} reserved",
              f"per rank, usable {gib(plan['usable_bytes'])} ({plan['gpu_memory_utilization']:g} x "
              f"{gib(plan['gpu_memory_bytes'])}):",
              f"{'tp':>4} {'weights':>11} {'workspace':>11} {'activations':>11} {'total':>11}  fits"]
    ranks = plan["ranks"] + ([plan["requested"]] if "requested" in plan and plan["requested"]["tp"] not in
                             [r["tp"] for r in plan["ranks"]] else [])
    for r in ranks:
        verdict = "yes" if r["fits"] else "no: " + "; ".join(r["problems"])
        lines.append(f"{r['tp']:>4} {gib(r['weight_bytes']):>11} {gib(r['workspace_bytes']):>11} "
                     f"{gib(r['activation_bytes']):>11} {gib(r['total_bytes']):>11}  {verdict}")
    shown = plan.get("requested") or next((r for r in ranks if r["tp"] == plan["smallest_tp"]), ranks[0])
    lines.append(f"activations at tp {shown['tp']}: "
                 + ", ".join(f"{k} {gib(v)}" for k, v in shown["activations"].items() if k != "total"))
    lines.append(f"smallest tp that fits: {plan['smallest_tp']}" if plan["smallest_tp"]
                 else f"no tensor-parallel size fits: {plan['reason']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`dsv4batch plan ARGS` (argv without "plan"); returns the exit code."""
    from dsv4batch.jobs.cli import PLAN_LIMITS, bad_numbers, build_parser
    from dsv4batch.model.config import ModelLoadError

    try:
        args = build_parser().parse_args(["plan", *argv])
    except SystemExit as exc:  # --help (0) or a bad option (2)
        return int(exc.code or 0) if isinstance(exc.code, int) else 2
    bad = bad_numbers(args, PLAN_LIMITS)
    if bad:
        print(f"dsv4batch plan: error: {'; '.join(bad)}", file=sys.stderr)
        return 2
    try:
        plan = make_plan(args)
    except (ModelLoadError, FileNotFoundError) as exc:
        print(f"dsv4batch plan: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=2) if args.json else render(plan))
    fits = plan["requested"]["fits"] if args.tp else plan["smallest_tp"] is not None
    return 0 if fits else 1
