"""Dispatch `python -m dsv4batch.bench NAME ...` to the repository's `bench/NAME.py`."""

from __future__ import annotations

import importlib
import os
import sys


def main(argv: list[str]) -> int:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    bench_dir = os.path.join(root, "bench")
    names = sorted(f[:-3] for f in os.listdir(bench_dir) if f.endswith(".py") and not f.startswith("_")) \
        if os.path.isdir(bench_dir) else []
    if not argv or argv[0] not in names:
        print(f"usage: python -m dsv4batch.bench NAME [--json] [args]; NAME one of {names}", file=sys.stderr)
        return 2
    sys.path.insert(0, root)
    importlib.import_module(f"bench.{argv[0]}").main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
