"""Argument parser for `dsv4batch score`, generated from `ScoreConfig`'s documented fields.

Every config field is an option (`max_batched_tokens` -> `--max-batched-tokens`), so the CLI,
the Python API and `_job.json` never drift apart. Only options given on the command line are
returned; everything else keeps the config default.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from dsv4batch.pipeline.config import ScoreConfig

GROUPS = {"model": "model", "scoring": "columns and scoring", "engine": "engine",
          "resources": "resources and Ray Data", "faults": "fault tolerance", "run": "run"}
POSITIONAL = ("input", "output")


def _scalar(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _optional(kind):
    def parse(text: str):
        return None if text.lower() in ("none", "auto", "") else kind(text)

    parse.__name__ = kind.__name__
    return parse


def build_parser(prog: str = "dsv4batch") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Offline DeepSeek-V4 batch scoring on Ray Data.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_parser(sub)
    score = sub.add_parser(
        "score", help="score the rows of a Parquet dataset",
        description="Score every row of INPUT (log-probabilities of its tokens) into OUTPUT.",
    )
    score.add_argument("input", metavar="INPUT", help=_help("input"))
    score.add_argument("output", metavar="OUTPUT", help=_help("output"))
    hints = typing.get_type_hints(ScoreConfig)
    groups = {k: score.add_argument_group(v) for k, v in GROUPS.items()}
    for f in dataclasses.fields(ScoreConfig):
        if f.name in POSITIONAL:
            continue
        flag = "--" + f.name.replace("_", "-")
        group = groups[f.metadata["group"]]
        text = f.metadata["help"] + ("" if f.default in (None, (), False) else
                                     f" Default: {f.default}.")
        # argparse %-formats help strings: a literal '%' must be doubled
        kw = {"dest": f.name, "default": argparse.SUPPRESS, "help": text.replace("%", "%%")}
        kind = _scalar(hints[f.name])
        if kind is bool:
            action = (argparse.BooleanOptionalAction if f.default else "store_true")
            group.add_argument(flag, action=action, **kw)
            continue
        if typing.get_origin(kind) is tuple:
            kind = str  # comma-separated; ScoreConfig splits it
        elif type(None) in typing.get_args(hints[f.name]):
            kind = _optional(kind)
        group.add_argument(flag, type=kind, choices=f.metadata["choices"],
                           metavar=None if f.metadata["choices"] else f.name.upper(), **kw)
    return parser


def add_plan_parser(sub) -> argparse.ArgumentParser:
    """`dsv4batch plan`: the capacity plan of one replica (`dsv4batch.jobs.plan`)."""
    from dsv4batch.model.capacity import TP_CHOICES
    from dsv4batch.model.config import EngineConfig

    fields = {f.name: f.default for f in dataclasses.fields(ScoreConfig)}
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


def _help(name: str) -> str:
    return next(f.metadata["help"] for f in dataclasses.fields(ScoreConfig)
                if f.name == name).replace("%", "%%")


def parse_config(argv: list[str], prog: str = "dsv4batch") -> ScoreConfig:
    """argv (without the program name) -> validated `ScoreConfig`; raises `UsageError`."""
    if argv and argv[0] not in ("score", "-h", "--help"):
        argv = ["score", *argv]  # `python -m dsv4batch.jobs.score INPUT OUTPUT ...`
    args = vars(build_parser(prog).parse_args(argv))
    args.pop("command", None)
    return ScoreConfig.from_dict(args)
