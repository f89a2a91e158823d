"""--resume: the recorded configuration, device kind and input files must still hold."""

import pytest

from dsv4batch.jobspec.config import ScoreConfig
from dsv4batch.jobspec.errors import UsageError
from dsv4batch.pipeline.resume import check_compute, check_config, check_inputs


def test_recorded_configuration_must_match():
    cfg = ScoreConfig(input="in", output="out", truncate="left")
    job = {"input": "in", "result": cfg.result_fields()}
    assert check_config(job, cfg.replace(replicas=4, batch_size=8))["input"] == "in"
    with pytest.raises(UsageError, match=r"in: text_column 'prompt' -> 'text'; truncate 'left' "
                                         r"-> 'none'\. Resume with the recorded settings"):
        check_config(job, cfg.replace(text_column="text", truncate="none"))
    notes = []
    check_config(job, cfg.replace(input="elsewhere"), notes.append)
    assert "differs from the recorded 'in'" in notes[0]


def test_device_kind_and_dtype_must_match_unless_allowed():
    """Finding 6: `auto` resolves to float32 on CPU and bfloat16 on CUDA."""
    cpu = ScoreConfig(gpus_per_replica=0).compute()
    gpu = ScoreConfig(gpus_per_replica=1).compute()
    assert cpu == {"device": "cpu", "dtype": "float32"}
    assert gpu == {"device": "cuda", "dtype": "bfloat16"}
    job, notes = {"compute": cpu}, []
    check_compute(job, cpu, False, notes.append)
    with pytest.raises(UsageError, match="scored on cpu in float32, this run would score on "
                                         "cuda in bfloat16.*--allow-device-change"):
        check_compute(job, gpu, False, notes.append)
    check_compute(job, gpu, True, notes.append)
    assert notes and "warning" in notes[0]


def test_changed_input_files_are_refused_with_derived_ids_and_reported_otherwise():
    """Finding 2: a rewritten file under derived ids would give rows other rows' scores."""
    before = [{"path": "a.parquet", "size": 10, "rows": 4, "footer": "f1"},
              {"path": "b.parquet", "size": 20, "rows": 5, "footer": "f2"}]
    now = [{"path": "a.parquet", "size": 12, "rows": 9, "footer": "f3"},
           {"path": "c.parquet", "size": 5, "rows": 1, "footer": "f4"}]
    job, notes = {"inputs": before}, []
    check_inputs(job, before, derived_ids=True, log=notes.append)
    assert notes == []
    with pytest.raises(UsageError, match=r"changed since the first run \(\['a.parquet'\]\)"):
        check_inputs(job, now, derived_ids=True, log=notes.append)
    check_inputs(job, now, derived_ids=False, log=notes.append)
    assert "warning" in notes[0] and "'a.parquet'" in notes[0]
    assert "1 added ['c.parquet'], 1 removed ['b.parquet']" in notes[1]


def test_a_changed_top_logprobs_is_refused():
    cfg = ScoreConfig(input="in", output="out", top_logprobs=4)
    job = {"input": "in", "result": cfg.result_fields()}
    with pytest.raises(UsageError, match=r"top_logprobs 4 -> 0"):
        check_config(job, cfg.replace(top_logprobs=0))
