"""Exceptions a scoring actor raises to steer Ray Data's fault handling (no torch, no ray).

`BatchError` is the one Ray Data retries: the pipeline lists it in
`DataContext.actor_task_retry_on_errors` (with `raise_original_map_exception`, so Ray sees it
unwrapped), and the ledger bounds the attempts. `TooManyErrors` is deliberately not retried: it
ends the job once more rows failed than `max_errored_rows` allows.
"""

from __future__ import annotations


class BatchError(RuntimeError):
    """An attempt at a batch failed as a whole (the engine raised for every row); retried."""


class TooManyErrors(RuntimeError):
    """More rows failed scoring than `max_errored_rows`; stops the job (never retried)."""


RETRIED = (BatchError,)
