"""The OUTPUT layout: refusing to mix runs, overwrite, and what --resume keeps."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsv4batch.jobspec.config import ScoreConfig
from dsv4batch.jobspec.errors import UsageError
from dsv4batch.pipeline import output as O


PART = "part-0123abcd-000000.parquet"
JOB = {"writer": "dsv4batch", "run_id": "0123abcd", "result": {}}


def prepare(out, overwrite=False, resume=False):
    """inspect then clear, as the runner does once every other check passed."""
    state = O.inspect_output(str(out), overwrite, resume)
    O.clear_output(state)
    return state


def test_output_refuses_to_mix_runs(tmp_path):
    out = tmp_path / "out"
    prepare(out)  # creates it
    (out / O.JOB).write_text(json.dumps(JOB))
    (out / PART).write_bytes(b"x")
    O.write_json(str(out), O.METRICS, {"rows": 1})
    assert json.loads((out / O.METRICS).read_text()) == {"rows": 1}
    with pytest.raises(UsageError, match="not empty"):
        prepare(out)
    prepare(out, overwrite=True)
    assert os.listdir(out) == []
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="did not write"):
        prepare(out, overwrite=True)
    with pytest.raises(UsageError, match="is a file"):
        prepare(out / "notes.txt", overwrite=True)


def test_a_run_that_wrote_no_part_leaves_an_empty_output(tmp_path):
    """An error after _job.json (finding 10): the corrected re-run needs no flag."""
    out = tmp_path / "out"
    out.mkdir()
    (out / O.JOB).write_text(json.dumps(JOB))
    (out / f"_tmp-{'a' * 32}.{PART}.inprogress").write_bytes(b"half")
    state = prepare(out)
    assert not state.resuming and os.listdir(out) == []


def test_overwrite_never_touches_what_is_not_ours(tmp_path):
    """A Spark output (finding 4): names like ours but no dsv4batch _job.json, nothing deleted."""
    out = tmp_path / "spark"
    out.mkdir()
    spark = ["part-00000-1b2c3d4e-aaaa-bbbb-cccc-0123456789ab-c000.snappy.parquet", "_SUCCESS"]
    for name in spark:
        (out / name).write_bytes(b"")
    for flags in ({"overwrite": True}, {"resume": True}):
        with pytest.raises(UsageError, match="did not write"):
            prepare(out, **flags)
    assert sorted(os.listdir(out)) == sorted(spark)
    (out / O.JOB).write_text('{"result": null}')  # finding 10: not ours, a clear refusal
    with pytest.raises(UsageError, match="was not written by dsv4batch"):
        prepare(out, overwrite=True)
    assert sorted(os.listdir(out)) == sorted([*spark, O.JOB])


def test_output_for_resume(tmp_path):
    out = tmp_path / "out"
    assert prepare(out, resume=True).resuming is False  # nothing to resume
    pq.write_table(pa.table({"id": [1, 2]}), out / PART)
    (out / f"_tmp-{'b' * 32}.part-0123abcd-000001.parquet.inprogress").write_bytes(b"half")
    for name in (O.METRICS, O.SUCCESS):
        (out / name).write_text("{}")
    with pytest.raises(UsageError, match="did not write"):  # parts without our _job.json
        prepare(out, resume=True)
    (out / O.JOB).write_text(json.dumps(JOB))
    state = O.inspect_output(str(out), overwrite=False, resume=True)
    assert state.resuming and len(os.listdir(out)) == 5  # inspecting deletes nothing
    O.clear_output(state)
    # the killed run's temporary file and the old _SUCCESS go; its part files stay
    assert sorted(os.listdir(out)) == [O.JOB, O.METRICS, PART]
    parts = O.finished_parts(str(out))
    assert (parts.rows, parts.id_type, len(parts.files)) == (2, pa.int64(), 1)
    (out / "mine.csv").write_text("x")
    with pytest.raises(UsageError, match="did not write"):
        prepare(out, resume=True)
    with pytest.raises(UsageError, match="--resume continues .* --overwrite replaces"):
        ScoreConfig(resume=True, overwrite=True)


def test_a_foreign_part_file_is_refused_by_name(tmp_path):
    """Finding 5: a part file with other columns is not this run's finished work."""
    out = tmp_path / "out"
    out.mkdir()
    pq.write_table(pa.table({"id": [1, 2], "foo": ["a", "b"]}), out / PART)
    columns = ["id", "num_tokens", "num_scored_tokens", "logprob_sum", "logprob_mean",
               "perplexity", "error"]
    with pytest.raises(UsageError, match=f"{PART}.*has columns \\['id', 'foo'\\], not this run"):
        O.finished_parts(str(out), columns)


def test_part_names():
    assert O.part_name("0123abcd", 7) == "part-0123abcd-000007.parquet"
    assert O.part_name("0123abcd", 7, 2) == "part-0123abcd-000007-0002.parquet"
    assert O.is_part("part-0123abcd-000007-0002.parquet")
    assert not O.is_part("part-00000-1b2c3d4e-aaaa-bbbb-cccc-0123456789ab-c000.snappy.parquet")
