"""Every error of a scoring job, and which of them Ray Data retries (no torch, no ray).

Exit codes of `dsv4batch score`: `UsageError` 2 (nothing was scored), `JobFailed` 1 (the files
written so far stay; the message says what to do). A scoring actor raises `BatchError` for an
attempt that failed as a whole: the pipeline lists `RETRIED` in
`DataContext.actor_task_retry_on_errors` (with `raise_original_map_exception`, so Ray sees it
unwrapped), and the batch ledger (`faults`) bounds the attempts. `TooManyErrors` is deliberately
not retried: it ends the job once more rows failed than `max_errored_rows` allows. A row that
cannot be scored is not an exception at all: it gets an `error` text (`row_error`).
"""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class UsageError(ValueError):
    """A bad argument, path or column: reported to the user (CLI exit code 2), never retried."""


class JobFailed(RuntimeError):
    """The job stopped (CLI exit code 1); the message says why and what is in OUTPUT."""


class RowCountError(JobFailed):
    """The written rows do not match the input rows (the row contract is broken)."""


class BatchError(RuntimeError):
    """An attempt at a batch failed as a whole (the engine raised for every row); retried."""


class ReplicaLost(BatchError):
    """A rank of a tensor-parallel replica died, hung past --collective-timeout-s or failed in a
    collective: its ranks were restarted and the batch is retried (never isolated row by row)."""


class TooManyErrors(RuntimeError):
    """More rows failed scoring than `max_errored_rows`; stops the job (never retried)."""


RETRIED = (BatchError,)


def one_line(exc: BaseException) -> str:
    """`exc` as one line for the user: Ray's wrapper exceptions unwrapped to their cause (a
    `RayTaskError` keeps the original in `.cause`), colour codes and traceback text dropped."""
    seen = set()
    while isinstance(getattr(exc, "cause", None), BaseException) and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.cause
    text = _ANSI.sub("", str(exc)).strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}"[:1000]


def row_error(exc: BaseException) -> str:
    """The `error` text of a row whose scoring raised `exc`: type and first line, <= 500 chars."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:500]
