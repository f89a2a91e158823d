"""The scoring actor's side of the batch ledger (`dsv4batch.pipeline.ledger`).

`begin` registers an attempt (the one call per batch that waits for the collector) and says
whether the batch already used up its attempts (then its rows are answered with an error,
naming the last cause); it raises `TooManyErrors` once the job's failed rows passed the limit.
`failed` records why an attempt raised; `end` reports the rows whose scoring failed without
waiting. Without a collector (an actor used alone) every batch is a first attempt.
"""

from __future__ import annotations

import hashlib
from typing import Any

from dsv4batch.actors.errors import TooManyErrors

DIED = "the scoring actor died while scoring this batch"


def ask(method, *args):
    """Call a collector method and wait for the answer (actor handle or in-process object)."""
    result = method.remote(*args)
    import ray

    return ray.get(result) if isinstance(result, ray.ObjectRef) else result


def batch_key(ids: list) -> str:
    """Digest of a batch's ids: a retry of the same input block gets the same key."""
    return hashlib.blake2b("\x1f".join(map(repr, ids)).encode(), digest_size=12).hexdigest()


class BatchGuard:
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

    def end(self, key: str, failed_rows: int, first_id: Any, cause: str | None,
            isolated: bool) -> None:
        if self.stats is not None:  # calls from one actor run in order: the next begin sees it
            self.stats.end_batch.remote(key, failed_rows, repr(first_id), cause, isolated)
