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
