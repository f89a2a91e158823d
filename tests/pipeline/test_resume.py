"""--resume: the recorded configuration must match."""

import pytest

from dsv4batch.pipeline import output as O
from dsv4batch.pipeline.config import ScoreConfig
from dsv4batch.pipeline.errors import UsageError
from dsv4batch.pipeline.resume import check_config


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
