"""The OUTPUT layout: refusing to mix runs, overwrite, and what --resume keeps."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsv4batch.pipeline import output as O
from dsv4batch.pipeline.config import ScoreConfig
from dsv4batch.pipeline.errors import UsageError


def test_prepare_output_refuses_to_mix_runs(tmp_path):
    out = tmp_path / "out"
    O.prepare_output(str(out), overwrite=False)  # creates it
    (out / "part-a-000000.parquet").write_bytes(b"x")
    O.write_json(str(out), O.METRICS, {"rows": 1})
    assert json.loads((out / O.METRICS).read_text()) == {"rows": 1}
    with pytest.raises(UsageError, match="not empty"):
        O.prepare_output(str(out), overwrite=False)
    O.prepare_output(str(out), overwrite=True)
    assert os.listdir(out) == []
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="did not write"):
        O.prepare_output(str(out), overwrite=True)
    with pytest.raises(UsageError, match="is a file"):
        O.prepare_output(str(out / "notes.txt"), overwrite=True)


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
    parts = O.finished_parts(str(out))
    assert (parts.rows, parts.id_type, len(parts.files)) == (2, pa.int64(), 1)
    (out / "mine.csv").write_text("x")
    with pytest.raises(UsageError, match="did not write.*refusing to resume in it"):
        O.prepare_output(str(out), overwrite=False, resume=True)
    with pytest.raises(UsageError, match="--resume continues .* --overwrite replaces"):
        ScoreConfig(resume=True, overwrite=True)
