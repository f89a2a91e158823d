"""Input discovery and column checks before Ray starts."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsv4batch.jobspec.config import ScoreConfig
from dsv4batch.jobspec.errors import UsageError
from dsv4batch.pipeline.read import check_input, inspect_input


def test_inspect_and_check_input(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        inspect_input(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no Parquet"):
        inspect_input(str(tmp_path / "empty"))
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"prompt": ["a", "b"], "n": [1, 2]}), d / "a.parquet")
    pq.write_table(pa.table({"prompt": ["c"], "n": [3]}), d / "sub" / "b.parquet")
    (d / "_tmp-x.parquet").write_bytes(b"junk")  # hidden: ignored
    info = inspect_input(str(d))
    assert info.num_rows == 3 and len(info.files) == 2 and info.root == str(d)
    assert inspect_input(str(d / "*.parquet")).files == [str(d / "a.parquet")]
    assert len(inspect_input(str(d / "**" / "*.parquet")).files) == 2
    assert inspect_input(str(d / "a.parquet")).num_rows == 2
    check_input(info, ScoreConfig())  # no id column: ids are derived
    with pytest.raises(UsageError, match=r"\['answer'\] not in .*available columns: \['n', 'prompt'\]"):
        check_input(info, ScoreConfig(target_column="answer"))
    with pytest.raises(UsageError, match="has type int64"):
        check_input(info, ScoreConfig(text_column="n"))
    with pytest.raises(UsageError, match="key"):
        check_input(info, ScoreConfig(id_column="key"))
