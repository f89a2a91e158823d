"""--resume building blocks without a cluster: OUTPUT preparation, the recorded configuration,
the bitmap of written rows and the read-side filter (against Ray's own row hash), the id
scan's classification of id groups, and the batch ledger."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsv4batch.pipeline import output as O
from dsv4batch.pipeline.config import ScoreConfig, UsageError
from dsv4batch.pipeline.idscan import KINDS, classify, partition_of
from dsv4batch.pipeline.ledger import BatchLedger
from dsv4batch.pipeline.resume import check_config, finished_parts
from dsv4batch.pipeline.rowset import KEY_SHIFT, RowBitmap, keep_pending


def test_prepare_output_for_resume(tmp_path):
    out = tmp_path / "out"
    assert O.prepare_output(str(out), overwrite=False, resume=True) is False  # nothing to resume
    pq.write_table(pa.table({"id": [1, 2]}), out / "part-a-000000.parquet")
    (out / "_tmp-x.part-a-000001.parquet.inprogress").write_bytes(b"half")
    for name in (O.METRICS, O.SUCCESS):
        (out / name).write_text("{}")
    with pytest.raises(UsageError, match="no _job.json: there is no run to resume"):
        O.prepare_output(str(out), overwrite=False, resume=True)
    (out / O.JOB).write_text("{}")
    assert O.prepare_output(str(out), overwrite=False, resume=True) is True
    # the killed run's temporary file and the old _SUCCESS go; its part files stay
    assert sorted(os.listdir(out)) == [O.JOB, O.METRICS, "part-a-000000.parquet"]
    parts = finished_parts(str(out))
    assert (parts.rows, parts.id_type, len(parts.files)) == (2, pa.int64(), 1)
    (out / "mine.csv").write_text("x")
    with pytest.raises(UsageError, match="did not write.*refusing to resume in it"):
        O.prepare_output(str(out), overwrite=False, resume=True)
    with pytest.raises(UsageError, match="--resume continues .* --overwrite replaces"):
        ScoreConfig(resume=True, overwrite=True)


def test_recorded_configuration_must_match(tmp_path):
    cfg = ScoreConfig(input="in", output=str(tmp_path), truncate="left")
    O.write_json(str(tmp_path), O.JOB, {"input": "in", "result": cfg.result_fields()})
    assert check_config(str(tmp_path), cfg.replace(replicas=4, batch_size=8))["input"] == "in"
    with pytest.raises(UsageError, match=r"in: text_column 'prompt' -> 'text'; truncate 'left' "
                                         r"-> 'none'\. Resume with the recorded settings"):
        check_config(str(tmp_path), cfg.replace(text_column="text", truncate="none"))
    notes = []
    check_config(str(tmp_path), cfg.replace(input="elsewhere"), notes.append)
    assert "differs from the recorded 'in'" in notes[0]


def test_row_bitmap_and_keep_pending_against_rays_row_hash():
    from ray.data._internal.datasource_v2.common.synthesized_columns import _compute_row_hashes

    files = ["/in/a.parquet", "/in/b.parquet", "/in/c.parquet"]
    written = RowBitmap(files, [10, 3, 5])
    written.add(np.array([2, 3, 9]) + (0 << KEY_SHIFT))
    written.add(np.array([0, 1, 2]) + (1 << KEY_SHIFT))  # all of b
    written.add(np.array([3, 3]))  # the same row twice sets one bit
    pending = written.pending()
    assert pending.skipped == 6 and pending.files == ["/in/a.parquet", "/in/c.parquet"]
    assert set(pending.done) == {"/in/a.parquet"}
    a, c = files[0], files[2]
    batch = pa.table({"prompt": [f"a{i}" for i in range(10)] + [f"c{i}" for i in range(5)],
                      "path": [a] * 10 + [c] * 5,
                      "row_hash": pa.array(np.concatenate([_compute_row_hashes(a, 0, 10),
                                                           _compute_row_hashes(c, 0, 5)]))})
    kept = keep_pending(batch, pending.done)["prompt"].to_pylist()
    assert kept == ["a0", "a1", "a4", "a5", "a6", "a7", "a8", "c0", "c1", "c2", "c3", "c4"]
    grown = RowBitmap(files, None)  # row counts unknown (more files than footers read)
    grown.add(np.array([1, 20]))
    assert grown.pending().skipped == 2 and grown.pending().files == files


def test_classify_one_partition_of_ids():
    # INPUT rows (in=1, their position as key) and OUTPUT ids (done=1, key -1)
    rows = [("a", 1, 0, 5), ("a", 1, 0, 6), (None, 1, 0, 7), (None, 1, 0, 8), ("b", 1, 0, 9),
            ("b", 0, 1, -1), ("c", 1, 0, 10), ("d", 0, 1, -1), ("e", 1, 0, 11), ("e", 0, 1, -1),
            ("e", 0, 1, -1)]
    ids, n_in, n_done, keys = zip(*rows)
    out = classify(pa.table({"id": list(ids), "__in": list(n_in), "__done": list(n_done),
                             "__key": list(keys), "__part": [0] * len(rows)}))
    got = sorted((KINDS[k], i, n, key) for k, i, n, key in zip(*(out[c].to_pylist() for c in
                                                                 ("kind", "id", "n", "key"))))
    assert got == [("done", None, 1, 9),  # b: written before, its position goes to the bitmap
                   ("dup_in", "'a'", 2, 6), ("dup_out", "'e'", 2, 11), ("null", "None", 2, 8),
                   ("orphan", "'d'", 1, -1)]  # c: still to score, not reported


@pytest.mark.parametrize("ids", [pa.array(["r1", "r22", "", None, "héllo"] * 40),
                                 pa.array(list(range(200)) + [None]),
                                 pa.array([b"\x00\xff", b"ab"] * 50, pa.binary())])
def test_partition_of_is_stable_and_spreads(ids):
    parts = partition_of(ids, 4)
    assert parts.min() >= 0 and parts.max() < 4
    assert np.array_equal(parts, partition_of(ids.slice(0), 4))
    values = ids.to_pylist()
    first = {}
    for v, p in zip(values, parts.tolist()):  # the same id: the same partition, always
        assert first.setdefault(v, p) == p
    if len(set(values)) > 50:
        assert len(set(parts.tolist())) == 4
    if pa.types.is_string(ids.type):  # string and large_string agree (ids cast on read)
        assert np.array_equal(parts, partition_of(ids.cast(pa.large_string()), 4))


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
