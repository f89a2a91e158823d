"""Argument parser for `dsv4batch score|generate`, generated from the job configs' documented fields.

Every CLI field of `ScoreConfig` / `GenerateConfig` is an option (`max_batched_tokens` ->
`--max-batched-tokens`), so the CLI, the Python API and `_job.json` never drift apart. Only
options given on the command line are returned; everything else keeps the config default.
"""

from __future__ import annotations

import argparse
import typing

from dsv4batch.jobspec.config import GROUPS, JOBS, MAX_GPU_MEMORY_GIB, ScoreConfig, cli_fields

POSITIONAL = ("input", "output")
DESCRIPTIONS = {
    "score": ("score the rows of a dataset", "Score every row of INPUT (log-probabilities of its tokens) into "
              "OUTPUT."),
    "generate": ("generate a continuation of every row", "Generate a continuation of every row's prompt in INPUT "
                 "(continuous batching, greedy or sampled) into OUTPUT."),
}


def _scalar(hint):
    """`X` of `Optional[X]`, else the hint itself."""
    if typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _optional(kind):
    def parse(text: str):
        return None if text.lower() in ("none", "auto", "") else kind(text)

    parse.__name__ = kind.__name__
    return parse


def build_parser(prog: str = "dsv4batch") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Offline DeepSeek-V4 batch scoring and generation on Ray Data.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_parser(sub)
    for task, cls in JOBS.items():
        short, long = DESCRIPTIONS[task]
        add_job_parser(sub.add_parser(task, help=short, description=long), cls)
    return parser


def add_job_parser(job: argparse.ArgumentParser, cls) -> None:
    """An option per CLI field of `cls` (a job config), in the fields' groups."""
    fields = cli_fields(cls)
    for name in POSITIONAL:
        job.add_argument(name, metavar=name.upper(), help=_escape(fields[name].description))
    groups = {k: job.add_argument_group(v) for k, v in GROUPS.items()}
    for name, f in fields.items():
        if name in POSITIONAL:
            continue
        flag = "--" + name.replace("_", "-")
        text = f.description + ("" if f.default in (None, (), False) else f" Default: {f.default}.")
        kw = {"dest": name, "default": argparse.SUPPRESS, "help": _escape(text)}
        hint = f.annotation
        kind = _scalar(hint)
        if kind is bool:
            group = groups[f.json_schema_extra["group"]]
            group.add_argument(flag, action=argparse.BooleanOptionalAction if f.default else "store_true", **kw)
            continue
        choices = typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else None
        if choices:
            kind = type(choices[0])
            if type(None) in typing.get_args(hint):
                choices = (None, *choices)
        if typing.get_origin(kind) is tuple:
            kind = str  # comma-separated; the config splits it
        elif type(None) in typing.get_args(hint):
            kind = _optional(kind)
        groups[f.json_schema_extra["group"]].add_argument(flag, type=kind, choices=choices,
                                                          metavar=None if choices else name.upper(), **kw)


def bad_numbers(args, limits: dict[str, tuple]) -> list[str]:
    """One message per parsed option of `args` (an argparse namespace) whose number breaks its
    rule in `limits`: {dest: (low, high, low_open)}, bounds None for none; floats must also be
    finite. Options left at None (not given) pass. The message names the flag and the value."""
    import math

    bad = []
    for dest, (low, high, low_open) in limits.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        ok = math.isfinite(value) and (low is None or (value > low if low_open else value >= low)) \
            and (high is None or value <= high)
        if not ok:
            rule = ("positive" if low == 0 and low_open else f">= {low}" if low is not None else "") + \
                (" and finite" if isinstance(value, float) else "") + \
                (f" (at most {high})" if high is not None else "")
            bad.append(f"--{dest.replace('_', '-')} must be {rule.strip()}, got {value!r}")
    return bad


PLAN_LIMITS = {"gpu_memory_gib": (0, MAX_GPU_MEMORY_GIB, True), "tp": (1, None, False),
               "max_model_len": (2, None, False), "max_batched_tokens": (1, None, False),
               "prefill_chunk_size": (1, None, False), "gpu_memory_utilization": (0, 1, True)}


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse %-formats help strings


def add_plan_parser(sub) -> argparse.ArgumentParser:
    """`dsv4batch plan`: the capacity plan of one replica (`dsv4batch.jobs.plan`)."""
    from dsv4batch.model.capacity import TP_CHOICES
    from dsv4batch.model.config import EngineConfig

    fields = {name: f.default for name, f in ScoreConfig.model_fields.items()}
    plan = sub.add_parser(
        "plan", help="how many GPUs one replica of a model needs (reads no weights)",
        description="Per-rank weight bytes, the planner's workspace reservation and one step's "
                    "activations of a checkpoint, from config.json and the safetensors headers only, "
                    f"and the smallest tensor-parallel size in {TP_CHOICES} that fits. Exit codes: 0 "
                    "it fits (with --tp: that size fits), 1 it does not, 2 bad arguments or model.")
    plan.add_argument("--model", required=True, help="Checkpoint folder or 'tiny'.")
    plan.add_argument("--gpu-memory-gib", type=float, required=True, help="Memory of one GPU in GiB (H200: 141).")
    plan.add_argument("--tp", type=int, help="Plan this tensor-parallel size (ranks per replica) only.")
    plan.add_argument("--max-model-len", type=int, default=fields["max_model_len"],
                      help=f"Longest request in tokens. Default: {fields['max_model_len']}.")
    plan.add_argument("--max-batched-tokens", type=int, default=fields["max_batched_tokens"],
                      help=f"Query tokens per forward step. Default: {fields['max_batched_tokens']}.")
    plan.add_argument("--prefill-chunk-size", type=int, default=EngineConfig.prefill_chunk_size,
                      help=f"Planner workspace budget. Default: {EngineConfig.prefill_chunk_size}.")
    plan.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                      help="Compute dtype of the GPUs. Default: bfloat16.")
    plan.add_argument("--weights", choices=("stored", "compute"), default="stored",
                      help="stored: FP8/FP4 weights stay quantized; compute: dequantized. Default: stored.")
    plan.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                      help="Share of a GPU's memory the replica may use. Default: 0.9.")
    plan.add_argument("--json", action="store_true", help="Print the plan as JSON.")
    return plan


def parse_config(argv: list[str], prog: str = "dsv4batch"):
    """argv (without the program name) -> validated `ScoreConfig` or `GenerateConfig` (by the
    subcommand; none: score); raises `UsageError`."""
    if argv and argv[0] not in (*JOBS, "-h", "--help"):
        argv = ["score", *argv]  # `python -m dsv4batch.jobs.score INPUT OUTPUT ...`
    args = vars(build_parser(prog).parse_args(argv))
    return JOBS[args.pop("command", "score")].from_dict(args)
