"""The batch ledger: attempts, isolation and the failed-row limit."""

import json

from dsv4batch.pipeline.faults import BatchLedger


def test_batch_ledger_counts_attempts_and_stops_past_the_limit():
    ledger = BatchLedger(max_failed_rows=3)
    assert ledger.begin_batch("k") == (1, None, None)
    ledger.fail_batch("k", "RuntimeError: boom")
    assert ledger.begin_batch("k") == (2, "RuntimeError: boom", None)
    assert ledger.end_batch("k", 2, "'x'", "scoring failed", isolated=True) is None
    assert ledger.begin_batch("k2") == (1, None, None)
    stop = ledger.end_batch("k2", 2, "'y'", "ValueError: vocab")
    assert ledger.begin_batch("k3")[2] == stop  # every later attempt learns the job must stop
    assert stop.startswith("4 rows failed scoring, more than max_errored_rows=3 (e.g. batch "
                           "from id 'x': scoring failed; batch from id 'y': ValueError: vocab)")
    snap = ledger.ledger_snapshot()
    assert (snap["retried_batches"], snap["isolated_batches"], snap["failed_rows"]) == (1, 1, 4)
    assert ledger.attempts == {"k3": 1} and json.dumps(snap)  # only the batch in flight


def test_explain_failure_by_records_and_exception_type():
    from ray.exceptions import ActorDiedError

    from dsv4batch.actors.guard import BatchGuard
    from dsv4batch.jobspec.errors import JobFailed, row_error
    from dsv4batch.pipeline.faults import explain_failure

    ledger = BatchLedger(max_failed_rows=0)
    guard = BatchGuard(Handle(ledger), max_attempts=2)
    guard.load_failed(FileNotFoundError("no tokenizer file at /m/tokenizer.json\nmore"))
    guard.load_failed(ValueError("second actor"))  # the first cause is the one reported
    why = explain_failure(ledger.ledger_snapshot(), RuntimeError("Ray's wrapped error text"))
    assert isinstance(why, JobFailed)
    assert str(why) == ("a scoring actor could not load the model: FileNotFoundError: no "
                        "tokenizer file at /m/tokenizer.json")
    # an actor that died, even wrapped in another exception, is named; others pass through
    died = RuntimeError("execution stopped")
    died.__cause__ = ActorDiedError()
    assert "died more often than --max-actor-restarts" in str(explain_failure({}, died))
    other = KeyError("x")
    assert explain_failure({}, other) is other
    ledger.end_batch("k", 1, "'r'", row_error(ValueError("bad")))
    assert str(explain_failure(ledger.ledger_snapshot())).startswith(
        "stopped: 1 rows failed scoring, more than max_errored_rows=0")


class Handle:
    """An in-process stand-in for the collector's actor handle: `h.method.remote(*args)`."""

    def __init__(self, target):
        self.target = target

    def __getattr__(self, name):
        method = getattr(self.target, name)
        return type("Method", (), {"remote": staticmethod(method)})
