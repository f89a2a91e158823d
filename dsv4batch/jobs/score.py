"""Entry point of `dsv4batch score` and of `python -m dsv4batch.jobs.score` (for Ray Jobs).

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
        python -m dsv4batch.jobs.score data/in.parquet /shared/out --replicas 8

Exit codes: 0 done, 1 the job failed, 2 bad arguments, paths or columns (nothing was scored).
"""

from __future__ import annotations

import signal
import sys
import threading

KEEP = "the rows written so far stay in OUTPUT; run again with --resume to finish"


class Terminated(KeyboardInterrupt):
    """SIGTERM (`ray job stop`, a scheduler's stop): handled like Ctrl-C."""


def _terminate(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    from dsv4batch.jobs.cli import parse_config
    from dsv4batch.jobs.report import trace_file
    from dsv4batch.jobspec.errors import JobFailed, UsageError, one_line

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:  # `dsv4batch plan ...`: the capacity plan, no Ray, no scoring
        from dsv4batch.jobs.plan import main as plan_main

        return plan_main(argv[1:])
    if argv[:1] == ["eval"]:  # `dsv4batch eval ...`: lm-eval tasks on the engine
        from dsv4batch.jobs.eval import main as eval_main

        return eval_main(argv[1:])
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    try:
        config = parse_config(argv)
        from dsv4batch.pipeline.runner import run

        run(config)
    except UsageError as exc:
        print(f"dsv4batch: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # argparse: --help (0) or a bad option (2)
        return int(exc.code or 0) if isinstance(exc.code, int) else 2
    except Terminated:
        print(f"dsv4batch: terminated (SIGTERM); {KEEP}", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"dsv4batch: interrupted; {KEEP}", file=sys.stderr)
        return 130
    except JobFailed as exc:  # already worded for the user
        print(f"dsv4batch: failed: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - the CLI reports every failure the same way
        print(f"dsv4batch: failed: {one_line(exc)} (full trace: {trace_file(exc)})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
