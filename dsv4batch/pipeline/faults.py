"""Fault handling, the driver's half: the ledger that each actor's guard
(`dsv4batch.actors.guard.BatchGuard`) calls through the `StatsCollector` actor.

Ray retries a batch whose scoring actor died or raised `BatchError` (`fault_settings`). A
crashed attempt leaves no trace in the actor, so each attempt starts by asking the ledger (kept
by the driver's `StatsCollector` actor) how many attempts the batch already had
(`BatchGuard.begin`, the one synchronous call per batch); once `max_batch_attempts` are spent
the actor answers the batch's rows with an error instead of scoring them, so a poison batch
cannot crash-loop the job. The ledger also counts the rows whose scoring failed and says when
they pass `max_errored_rows` (a broken engine stops the job instead of writing a dataset of
errors); that answer rides on the next `begin` (`end` is fire-and-forget) and the driver checks
it once more after the last batch. A model that raises while loading is recorded by type, where
it was raised (`BatchGuard.load_failed`), and `explain_failure` turns the stopped execution into
one `JobFailed` line from those records and the exception's type, never from its message text.
The ledger holds only batches in flight or failing (keyed by a digest of their ids).
"""

from __future__ import annotations

from typing import Any

from dsv4batch.jobspec.errors import RETRIED, JobFailed

MAX_EXAMPLES = 5
KEEP = ("the rows written so far stay in OUTPUT; fix the cause and run again with --resume "
        "(raise --max-errored-rows to accept more failed rows)")


def fault_settings(ctx) -> None:
    """The Ray Data fault handling the row contract relies on, on a (dataset's) DataContext."""
    ctx.max_errored_blocks = 0  # a failed block fails the run: rows are never dropped silently
    # a BatchError is retried (the ledger bounds the attempts); Ray matches the retry list
    # against the exception the task raised, so Ray Data must not wrap it in UserCodeException
    ctx.raise_original_map_exception = True
    ctx.actor_task_retry_on_errors = list(RETRIED)
    # a model that cannot load fails the job at the first actor, not after endless replacements
    ctx.max_consecutive_actor_init_deaths = 0
    ctx.actor_init_retry_on_errors = False


# -- the driver's half: kept by the StatsCollector actor ----------------------------------------

class BatchLedger:
    def __init__(self, max_failed_rows: int | None = None):
        self.max_failed_rows = max_failed_rows
        self.attempts: dict[str, int] = {}
        self.causes: dict[str, str] = {}
        self.failed_rows = 0
        self.retried_batches = 0  # batches that needed a second attempt
        self.isolated_batches = 0  # batches answered with errors after max attempts
        self.failures: list[dict[str, Any]] = []  # first examples, for the summary
        self.load_failure: str | None = None  # the first model-load failure of an actor

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

    def fail_load(self, cause: str) -> None:
        """A scoring actor's model raised while loading (`cause`: type and first line)."""
        self.load_failure = self.load_failure or cause

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
                "failures": [dict(f) for f in self.failures], "load_failure": self.load_failure,
                "stop": self.stop_message()}


def explain_failure(ledger: dict, exc: BaseException | None = None) -> BaseException | None:
    """The reason an execution stopped, as one `JobFailed` line where it is known, else `exc`.

    `ledger`: the collector's `ledger_snapshot()` (empty when it could not be read); `exc`: what
    the execution raised (None when it finished but the ledger says stop)."""
    if ledger.get("stop"):
        return JobFailed(f"stopped: {ledger['stop']}; {KEEP}")
    if ledger.get("load_failure"):
        return JobFailed(f"a scoring actor could not load the model: {ledger['load_failure']}")
    from ray.exceptions import ActorDiedError

    if any(isinstance(e, ActorDiedError) for e in _chain(exc)):
        first = (str(exc).splitlines() or [""])[0]
        return JobFailed(f"a scoring actor's process died more often than --max-actor-restarts "
                         f"allows (killed while loading the model?): {first}; {KEEP}")
    return exc


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__
