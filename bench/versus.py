"""This checkout's engine against another checkout's (an earlier commit), end to end, interleaved.

`git worktree add /tmp/old 5b1d996`, then `python -m dsv4batch.bench versus --against /tmp/old
[--models tiny,dsv4-shape,unseen] [--lengths 512,2048,8192] [--repeats 3]`: each checkout's
engine runs in a process of its own (`bench/_versus_child.py`, with that checkout's `dsv4batch` and
its own API), both alive at once and asked in turn for one timed call on the same prompts, so
the machine's noise hits both alike; best of `--repeats`. Per model and length: tokens/s of each
and ours / theirs. Headed by the CPU and our kernels' ISA (`--isa`; the other checkout builds what
it builds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench.common import emit, machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(ROOT, "bench", "_versus_child.py")


class Child:
    """One checkout's engine on one model, in its own process (`_versus_child.py`)."""

    def __init__(self, checkout: str, model: str, isa: str):
        env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout), DSV4BATCH_BENCH_ISA=isa)
        self.proc = subprocess.Popen([sys.executable, CHILD, model], cwd=checkout, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self._read()  # loaded and warm

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine process ended (exit code {self.proc.wait()})")
        return json.loads(line)

    def seconds(self, lengths, seed: int) -> float:
        self.proc.stdin.write(json.dumps({"lengths": lengths, "seed": seed}) + "\n")
        self.proc.stdin.flush()
        return self._read()["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def compare(model: str, against: str, lengths, repeats: int, isa: str) -> dict:
    """Per length: ours and theirs in tokens/s (best of `repeats`, asked in turn), and the ratio."""
    ours, theirs = Child(ROOT, model, isa), Child(against, model, isa)
    rows = {}
    try:
        for n in lengths:
            best = {"ours": float("inf"), "theirs": float("inf")}
            for _ in range(repeats):
                for name, child in (("theirs", theirs), ("ours", ours)):
                    best[name] = min(best[name], child.seconds([n], seed=n))
            rows[f"single{n}"] = {"tokens": n - 1, "ours_tok_s": round((n - 1) / best["ours"], 1),
                                  "theirs_tok_s": round((n - 1) / best["theirs"], 1),
                                  "ours_over_theirs": round(best["theirs"] / best["ours"], 3)}
    finally:
        ours.close(), theirs.close()
    return rows


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m dsv4batch.bench versus")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--against", required=True, help="another checkout of this repository (a git worktree)")
    parser.add_argument("--models", default="tiny,dsv4-shape,unseen")
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--isa", default="native", help="our C++ kernels' build: native, avx512, avx2 or generic")
    args = parser.parse_args(argv)
    result = {"bench": "versus", **machine(args.isa), "against": os.path.abspath(args.against), "models": {}}
    for model in args.models.split(","):
        lengths = [int(n) for n in args.lengths.split(",")]
        result["models"][model] = compare(model, args.against, lengths, args.repeats, args.isa)
    emit(result, args.json)
