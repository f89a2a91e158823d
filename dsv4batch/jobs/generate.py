"""`python -m dsv4batch.jobs.generate INPUT OUTPUT ...`: `dsv4batch generate` for `ray job submit`.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
        python -m dsv4batch.jobs.generate data/prompts.parquet /shared/out --max-tokens 128

Exit codes as `dsv4batch score` (`dsv4batch.jobs.score`).
"""

from __future__ import annotations

import sys

from dsv4batch.jobs.score import main as _main


def main(argv: list[str] | None = None) -> int:
    return _main(["generate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
