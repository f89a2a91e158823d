"""Entry point of `dsv4batch score` and of `python -m dsv4batch.jobs.score` (for Ray Jobs).

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
        python -m dsv4batch.jobs.score data/in.parquet /shared/out --replicas 8

Exit codes: 0 done, 1 the job failed, 2 bad arguments, paths or columns (nothing was scored).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from dsv4batch.jobs.cli import parse_config
    from dsv4batch.pipeline.errors import JobFailed, UsageError

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        config = parse_config(argv)
        from dsv4batch.pipeline.runner import run

        run(config)
    except UsageError as exc:
        print(f"dsv4batch: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # argparse: --help (0) or a bad option (2)
        return int(exc.code or 0) if isinstance(exc.code, int) else 2
    except KeyboardInterrupt:
        print("dsv4batch: interrupted", file=sys.stderr)
        return 130
    except JobFailed as exc:  # already worded for the user
        print(f"dsv4batch: failed: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - the CLI reports every failure the same way
        print(f"dsv4batch: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
