"""Faults while a job runs, on one local Ray for the module: a scoring actor killed mid-run,
the `dsv4batch score` driver SIGKILLed and the run resumed, batches that keep failing (retried,
isolated as row errors, then the error limit stops the job), and --resume refusing a changed
configuration. Drivers that must die or need another environment run as subprocesses that join
the module's Ray, as a job on a shared cluster would."""

import json
import os
import re
import signal
import subprocess
import sys
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsv4batch.jobs.score import main
from tests.jobs.conftest import (REPO, SMALL_PARTS, alive_pipeline_actors, finished, part_rows,
                                 parts, wait_for, write_input)

def test_killed_scoring_actor_is_restarted_and_the_job_completes(tmp_path, checkpoint, local_ray):
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    ids = write_input(src, 64)
    killed = {}

    def kill_one_scoring_actor():
        try:
            wait_for(lambda: parts(out), "the first part file")
            actor = next(a for a in alive_pipeline_actors(local_ray)
                         if "ScoringActor" in a.class_name)
            killed.update(pid=actor.pid, parts=len(parts(out)))
            os.kill(actor.pid, signal.SIGKILL)
        except Exception as exc:  # noqa: BLE001 - reported by the test below
            killed["error"] = exc

    killer = threading.Thread(target=kill_one_scoring_actor, daemon=True)
    killer.start()
    assert main([str(src), str(out), "--model", checkpoint, *SMALL_PARTS]) == 0
    killer.join(timeout=10)
    assert "error" not in killed and "pid" in killed, killed
    rows, metrics = finished(out, ids)
    assert all(r["error"] is None for r in rows.values())  # the retried batches scored
    assert len(parts(out)) > killed["parts"]  # the kill came while the job still had work
    actor = metrics["actors"][0]
    assert metrics["num_actors"] == 1 and actor["restarts"] == 1
    assert actor["pids"][0] == killed["pid"] != actor["pids"][1]


def test_killed_driver_then_resume_scores_only_the_missing_rows(tmp_path, checkpoint, local_ray):
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    ids = write_input(src, 64, with_ids=False)  # ids derived from file and row: both runs agree
    args = [str(src), str(out), "--model", checkpoint, *SMALL_PARTS]
    with open(tmp_path / "driver.log", "w") as log:
        driver = subprocess.Popen([sys.executable, "-m", "dsv4batch.jobs.score", *args,
                                   "--ray-address", local_ray], stdout=log, stderr=log, cwd=REPO)
        wait_for(lambda: parts(out), "the first part file", proc=driver)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    # Ray ends a dead driver's job (its actors and tasks); a straggling write would otherwise
    # land after the rows already written were counted
    wait_for(lambda: not alive_pipeline_actors(local_ray), "the killed job's actors to stop", 120)
    assert "_SUCCESS" not in os.listdir(out)
    written = part_rows(out)
    assert 0 < written < len(ids)
    assert main([*args, "--resume"]) == 0
    rows, metrics = finished(out, ids)
    assert metrics["resumed"] and metrics["rows_skipped"] == written
    assert metrics["rows"] == len(ids) - written  # scored only what was missing
    # the killed run wrote no summary: the total counts the finished run, OUTPUT holds all
    assert metrics["total"]["num_runs"] == 1 and metrics["rows_in_output"] == len(ids)
    with open(out / "_job.json") as f:
        assert [r["resumed"] for r in json.load(f)["runs"]] == [False, True]
    # nothing left: another --resume finishes without starting a scoring actor
    assert main([*args, "--resume"]) == 0
    _, metrics = finished(out, ids)
    assert (metrics["rows"], metrics["rows_skipped"], metrics["num_actors"]) == (0, len(ids), 0)
    # finding 11: a no-op resume keeps the totals of the runs before it
    assert metrics["total"]["num_runs"] == 2 and metrics["total"]["rows"] == len(ids) - written
    assert [r["rows"] for r in metrics["runs"]] == [len(ids) - written, 0]


@pytest.mark.parametrize("with_ids", [True, False])
def test_resume_read_streams_only_the_rows_left(tmp_path, local_ray, with_ids):
    """The read a resumed run scores: written rows dropped in the read tasks (by position), a
    file with every row written not read at all, the same columns as a fresh read."""
    from dsv4batch.jobspec.config import ScoreConfig
    from dsv4batch.pipeline.ids.rowset import KEY_SHIFT, RowBitmap
    from dsv4batch.pipeline.read import inspect_input, read

    d = tmp_path / "in"
    d.mkdir()
    ids = write_input(d / "a.parquet", 40, with_ids) + write_input(d / "b.parquet", 8, with_ids)
    config = ScoreConfig(input=str(d), output=str(tmp_path / "out"))
    info = inspect_input(config.input)
    written = RowBitmap(info.files, info.file_rows)
    written.add(np.array([0, 1, 2, 17, 39]))  # rows of a.parquet
    written.add(np.arange(8) + (1 << KEY_SHIFT))  # all of b.parquet
    pending = written.pending()
    assert pending.files == [str(d / "a.parquet")] and pending.skipped == 13
    rows = read(config, info, pending).take_all()
    left = [i for k, i in enumerate(ids[:40]) if k not in (0, 1, 2, 17, 39)]
    assert sorted(r["id"] for r in rows) == sorted(left)
    assert all(sorted(r) == ["id", "prompt"] for r in rows)  # no path/row_hash left behind


def test_resume_refuses_another_configuration(tmp_path, capsys):
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    write_input(src, 4)
    out.mkdir()
    (out / "_job.json").write_text(json.dumps({"writer": "dsv4batch", "result": {
        "model": "tiny", "dtype": "auto", "text_column": "prompt", "target_column": None,
        "id_column": "id", "keep_columns": [], "token_logprobs": False, "max_model_len": 8192,
        "truncate": "none"}}))
    pq.write_table(pa.table({"id": ["row-0"]}), out / "part-0123abcd-000000.parquet")
    assert main([str(src), str(out), "--resume", "--max-model-len", "99", "--token-logprobs"]) == 2
    err = capsys.readouterr().err
    assert "in: max_model_len 8192 -> 99; token_logprobs False -> True." in err
    assert main([str(src), str(out)]) == 2  # neither --resume nor --overwrite
    assert "is not empty; pass --resume" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["_job.json", "part-0123abcd-000000.parquet"]


BROKEN_DRIVER = """import sys, ray
ray.init(address=sys.argv[1], logging_level="WARNING")
from dsv4batch.jobs.score import main
# every forward raises: the FlashMLA backend forced where it cannot run (no CUDA here)
sys.exit(main(sys.argv[2:] + ["--attn-backend", "flashmla"]))
"""


def run_broken(address, args):
    return subprocess.run([sys.executable, "-c", BROKEN_DRIVER, address, *map(str, args)],
                          capture_output=True, text=True, timeout=400, cwd=REPO)


def test_failing_batches_are_retried_isolated_then_stop_the_job(tmp_path, checkpoint, local_ray):
    """Every batch fails: each is retried (max_batch_attempts 2), then its rows are answered
    with an error; once they pass --max-errored-rows the job stops with the cause. (Isolated
    batches finishing a job, and resuming, are covered in-process and by the resume test.)"""
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    write_input(src, 24)
    run = run_broken(local_ray, [src, out, "--model", checkpoint, "--max-batch-attempts", "2",
                                 "--max-errored-rows", "5", *SMALL_PARTS])
    assert run.returncode == 1, run.stderr[-3000:]
    isolated = "scoring failed 2 time(s): RuntimeError: flashmla backend requested but unavailable"
    stop = next(line for line in run.stderr.splitlines() if "dsv4batch: failed: " in line)
    # more than 5 failed rows: at least two batches of 4 were retried, then isolated (a batch
    # already running when the limit was passed may add its 4)
    failed = re.search(r"failed: stopped: (\d+) rows failed scoring, more than max_errored_rows=5",
                       stop)
    assert failed and int(failed.group(1)) >= 8 and int(failed.group(1)) % 4 == 0, stop
    assert "batch from id 'row-" in stop and isolated in stop and "--resume" in stop
    assert "_SUCCESS" not in os.listdir(out)
    written = pq.read_table(str(out)).to_pylist() if parts(out) else []
    assert all(r["error"].startswith(isolated) for r in written)  # answered, never dropped
