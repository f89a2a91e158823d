"""Fault handling, the actor's half: each replica actor's guard around the driver's ledger
(`dsv4batch.pipeline.faults.BatchLedger`, kept by the `StatsCollector` actor; the protocol is
described there). The two halves share no code: the guard calls the ledger's methods by name,
through an actor handle (or an in-process object in tests).
"""

from __future__ import annotations

import hashlib
from typing import Any

from dsv4batch.jobspec.errors import TooManyErrors, row_error

DIED = "the scoring actor died (or hung past --batch-timeout-s) while scoring this batch"


def ask(method, *args):
    """Call a collector method and wait for the answer (actor handle or in-process object)."""
    result = method.remote(*args)
    import ray

    return ray.get(result) if isinstance(result, ray.ObjectRef) else result


def batch_key(ids: list) -> str:
    """Digest of a batch's ids: a retry of the same input block gets the same key."""
    return hashlib.blake2b("\x1f".join(map(repr, ids)).encode(), digest_size=12).hexdigest()


class BatchGuard:
    """A scoring actor's calls into the ledger; without a collector every batch is a first try.

    `begin` registers an attempt and says whether the batch already used up its attempts (then
    its rows are answered with an error naming the last cause); it raises `TooManyErrors` once
    the job's failed rows passed the limit. `failed` records why an attempt raised; `end`
    reports the rows whose scoring failed, without waiting."""

    def __init__(self, stats: Any, max_attempts: int):
        self.stats, self.max_attempts = stats, max_attempts

    def begin(self, ids: list) -> tuple[str, str | None]:
        """(key, isolation message or None when this attempt should score the batch)."""
        key = batch_key(ids)
        if self.stats is None:
            return key, None
        attempt, cause, stop = ask(self.stats.begin_batch, key)
        if stop:
            raise TooManyErrors(stop)
        if attempt <= self.max_attempts:
            return key, None
        return key, f"scoring failed {attempt - 1} time(s): {cause or DIED}"

    def failed(self, key: str, cause: str) -> None:
        if self.stats is not None:
            ask(self.stats.fail_batch, key, cause)

    def load_failed(self, exc: BaseException) -> None:
        """Record a model-load failure before the actor's constructor re-raises it."""
        if self.stats is not None:
            ask(self.stats.fail_load, row_error(exc))

    def end(self, key: str, failed_rows: int, first_id: Any, cause: str | None,
            isolated: bool) -> None:
        if self.stats is not None:  # calls from one actor run in order: the next begin sees it
            self.stats.end_batch.remote(key, failed_rows, repr(first_id), cause, isolated)
