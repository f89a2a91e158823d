"""Batch attempts and scoring failures, kept by the driver's `StatsCollector` actor.

Ray retries a batch whose scoring actor died or raised `BatchError`. A crashed attempt leaves no
trace in the actor, so each attempt starts by asking the ledger how many attempts the batch
already had; once `max_batch_attempts` are spent the actor answers the batch's rows with an
error instead of scoring them (a poison batch cannot crash-loop the job). The ledger also counts
the rows whose scoring failed and says when they pass `max_errored_rows`, so a broken engine
stops the job instead of writing a dataset of errors. That answer rides on the next
`begin_batch` (the one synchronous call per batch; `end_batch` is fire-and-forget) and the
driver checks it once more after the last batch. The ledger holds only batches in flight or
failing (keyed by a digest of their ids), never one entry per row.
"""

from __future__ import annotations

from typing import Any

MAX_EXAMPLES = 5


class BatchLedger:
    def __init__(self, max_failed_rows: int | None = None):
        self.max_failed_rows = max_failed_rows
        self.attempts: dict[str, int] = {}
        self.causes: dict[str, str] = {}
        self.failed_rows = 0
        self.retried_batches = 0  # batches that needed a second attempt
        self.isolated_batches = 0  # batches answered with errors after max attempts
        self.failures: list[dict[str, Any]] = []  # first examples, for the summary

    def begin_batch(self, key: str) -> tuple[int, str | None, str | None]:
        """Register an attempt: (its number, the last failure's cause, the stop message)."""
        n = self.attempts.get(key, 0) + 1
        self.attempts[key] = n
        if n == 2:
            self.retried_batches += 1
        return n, self.causes.get(key), self.stop_message()

    def fail_batch(self, key: str, cause: str) -> None:
        """The attempt raised (it will be retried): remember why, for the isolated rows."""
        self.causes[key] = cause

    def end_batch(self, key: str, failed_rows: int, first_id: Any = None,
                  cause: str | None = None, isolated: bool = False) -> str | None:
        """The attempt returned rows; returns the stop message once failures pass the limit."""
        self.attempts.pop(key, None)
        self.causes.pop(key, None)
        self.isolated_batches += bool(isolated)
        if failed_rows:
            self.failed_rows += failed_rows
            if len(self.failures) < MAX_EXAMPLES:
                self.failures.append({"first_id": first_id, "rows": failed_rows, "cause": cause})
        return self.stop_message()

    def stop_message(self) -> str | None:
        if self.max_failed_rows is None or self.failed_rows <= self.max_failed_rows:
            return None
        causes = "; ".join(f"batch from id {f['first_id']}: {f['cause']}" for f in self.failures)
        return (f"{self.failed_rows} rows failed scoring, more than max_errored_rows="
                f"{self.max_failed_rows} (e.g. {causes})")

    def ledger_snapshot(self) -> dict[str, Any]:
        return {"failed_rows": self.failed_rows, "max_failed_rows": self.max_failed_rows,
                "retried_batches": self.retried_batches,
                "isolated_batches": self.isolated_batches,
                "failures": [dict(f) for f in self.failures], "stop": self.stop_message()}
