"""Reliability, round two (issue 13): one test per finding, each reproducing what broke and
checking the row contract (every id exactly once) and that nothing foreign was deleted.

Refusals that need no Ray come first; the rest share the module's local Ray."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsv4batch.jobs.score import main
from tests.jobs.conftest import (FAST, REPO, SMALL_PARTS, alive_pipeline_actors, finished, parts,
                                 wait_for, write_input)



def score(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def snapshot(folder) -> dict:
    return {n: (folder / n).read_bytes() for n in sorted(os.listdir(folder))}


@contextlib.contextmanager
def running_job(log_path, args, address, n: int = 48):
    """A `dsv4batch score` driver in a subprocess on the module's Ray, once its first part file
    is written: (the process, the ids its OUTPUT must hold)."""
    src, out = args[0], args[1]
    ids = write_input(src, n, with_ids=False)
    with open(log_path, "w") as log:
        job = subprocess.Popen([sys.executable, "-m", "dsv4batch.jobs.score", *map(str, args),
                                "--ray-address", address], stdout=log, stderr=log, cwd=REPO)
        wait_for(lambda: parts(out), "the job's first part file", proc=job)
        yield job, ids


# -- refused before Ray starts ---------------------------------------------------------------

def test_f3_an_existing_path_is_literal_never_a_glob(tmp_path):
    from dsv4batch.pipeline.read import inspect_input

    pq.write_table(pa.table({"prompt": ["a"] * 4}), tmp_path / "data[1].parquet")
    pq.write_table(pa.table({"prompt": ["b"] * 9}), tmp_path / "data1.parquet")
    info = inspect_input(str(tmp_path / "data[1].parquet"))
    assert info.files == [str(tmp_path / "data[1].parquet")] and info.num_rows == 4
    # a path that does not exist is still a pattern
    assert inspect_input(str(tmp_path / "data[0-9].parquet")).num_rows == 9


def test_f4_overwrite_refuses_a_spark_output_and_deletes_nothing(tmp_path, capsys):
    src = tmp_path / "in.parquet"
    write_input(src, 4)
    out = tmp_path / "spark"
    out.mkdir()
    pq.write_table(pa.table({"x": [1]}), out / "part-00000-1b2c3d4e-aa-c000.snappy.parquet")
    (out / "_SUCCESS").write_bytes(b"")
    before = snapshot(out)
    code, err = score(capsys, src, out, "--overwrite")
    assert code == 2 and "holds files dsv4batch did not write" in err
    assert snapshot(out) == before


def test_f7_unresumable_inputs_are_refused_up_front(tmp_path, capsys):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [1, 2], "prompt": ["a", "b"], "path": ["x", "y"]}), src)
    code, err = score(capsys, src, tmp_path / "o1", "--keep-columns", "path")
    assert code == 2 and "input column(s) ['path'] cannot be used" in err
    d = tmp_path / "q"
    d.mkdir()
    pq.write_table(pa.table({"prompt": ["a"]}), d / "what?.parquet")
    code, err = score(capsys, d, tmp_path / "o2")
    assert code == 2 and "what?.parquet" in err and "'?'" in err
    assert not os.path.exists(tmp_path / "o1") or not parts(tmp_path / "o1")


def test_f10_numbers_must_be_finite_and_id_kinds_agree(tmp_path, capsys):
    src = tmp_path / "in.parquet"
    write_input(src, 2)
    for flag, value in (("--max-block-mib", "nan"), ("--max-buffered-mib", "inf"),
                        ("--cpus-per-replica", "nan")):
        code, err = score(capsys, src, tmp_path / "o", flag, value)
        assert code == 2 and f"{flag[2:].replace('-', '_')!r}: must be a finite number" in err
    d = tmp_path / "mixed"
    d.mkdir()
    pq.write_table(pa.table({"id": [1, 2], "prompt": ["a", "b"]}), d / "a.parquet")
    pq.write_table(pa.table({"id": ["x"], "prompt": ["c"]}), d / "b.parquet")
    code, err = score(capsys, d, tmp_path / "o")
    assert code == 2 and "different kinds of type across INPUT's files" in err
    assert "int64 in" in err and "b.parquet" in err and "\x1b" not in err


def test_f10_a_job_json_that_is_not_ours_is_a_clear_refusal(tmp_path, capsys):
    src = tmp_path / "in.parquet"
    write_input(src, 2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "_job.json").write_text('{"result": null}')
    code, err = score(capsys, src, out, "--resume")
    assert code == 2 and "_job.json was not written by dsv4batch" in err
    assert (out / "_job.json").read_text() == '{"result": null}'


def test_f9_an_unreachable_ray_address_fails_fast(tmp_path, run_cli):
    src = tmp_path / "in.parquet"
    write_input(src, 2)
    t0 = time.time()
    run = run_cli(src, tmp_path / "out", "--ray-address", "127.0.0.1:1", timeout=120, cwd=REPO)
    assert run.returncode == 2 and "cannot reach the Ray cluster at '127.0.0.1:1'" in run.stderr
    assert time.time() - t0 < 60


def test_f1_a_stale_lease_is_taken_over_and_a_live_one_refuses(tmp_path, capsys):
    from dsv4batch.jobspec.errors import UsageError
    from dsv4batch.pipeline.fs import open_fs
    from dsv4batch.pipeline.lease import Lease

    out = tmp_path / "out"
    held = Lease(*open_fs(str(out)), "aaaaaaaa").acquire()
    with pytest.raises(UsageError, match=r"being written by another job \(run aaaaaaaa, pid "
                                         rf"{os.getpid()}"):
        Lease(*open_fs(str(out)), "bbbbbbbb").acquire()
    held._stop.set()  # the holder stops renewing: stale once TTL_S passed
    record = json.loads((out / "_lease.json").read_text())
    record["renewed"] -= 3600
    (out / "_lease.json").write_text(json.dumps(record))
    notes = []
    taker = Lease(*open_fs(str(out)), "cccccccc", notes.append).acquire()
    assert "taking over the stale lease of run aaaaaaaa" in notes[0]
    assert json.loads((out / "_lease.json").read_text())["run_id"] == "cccccccc"
    held.release()  # not its lease any more: left alone
    assert (out / "_lease.json").exists()
    taker.release()
    assert os.listdir(out) == []


# -- on the module's Ray -----------------------------------------------------------------------

def test_f1_a_second_job_on_a_running_output_is_refused(tmp_path, capsys, checkpoint, local_ray):
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    args = [src, out, "--model", checkpoint, *SMALL_PARTS]
    with running_job(tmp_path / "first.log", args, local_ray) as (first, ids):
        # paused, so it cannot finish (and release its lease) during the second job's checks;
        # its lease stays fresh for lease.TTL_S (60 s) without renewals
        first.send_signal(signal.SIGSTOP)
        try:
            for flags in (["--resume"], ["--overwrite"]):
                code, err = score(capsys, *args, *flags)
                assert code == 2 and "is being written by another job" in err, err
        finally:
            first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=300) == 0
    finished(out, ids)  # every id exactly once: the second job wrote and deleted nothing


@pytest.fixture(scope="module")
def done_run(tmp_path_factory, checkpoint, local_ray):
    """A finished run with derived ids: (src, out, ids, args)."""
    tmp = tmp_path_factory.mktemp("done")
    src, out = tmp / "in.parquet", tmp / "out"
    ids = write_input(src, 24, with_ids=False)
    args = [str(src), str(out), "--model", checkpoint, *SMALL_PARTS]
    assert main(args) == 0
    return src, out, ids, args


def test_f2_f8_resume_refuses_a_rewritten_input_and_leaves_output_as_it_was(done_run, capsys):
    src, out, ids, args = done_run
    before = snapshot(out)
    table = pq.read_table(src)
    pq.write_table(pa.concat_tables([table.slice(0, 5), table]), src, row_group_size=16)
    try:
        code, err = score(capsys, *args, "--resume")
        assert code == 2 and "changed since the first run (['in.parquet'])" in err
        code, err = score(capsys, *args, "--resume", "--token-logprobs")
        assert code == 2 and "token_logprobs False -> True" in err
    finally:
        pq.write_table(table, src, row_group_size=16)
    assert snapshot(out) == before  # _SUCCESS and _job.json untouched by the refusals
    finished(out, ids)


def test_f5_resume_refuses_a_foreign_part_file(done_run, capsys, tmp_path):
    src, out, ids, args = done_run
    copy = tmp_path / "out"
    copy.mkdir()
    for name, data in snapshot(out).items():
        (copy / name).write_bytes(data)
    pq.write_table(pa.table({"id": ["x"], "foo": ["y"]}), copy / "part-0123abcd-000099.parquet")
    code, err = score(capsys, src, copy, *args[2:], "--resume")
    assert code == 2 and "part-0123abcd-000099.parquet" in err and "not this run's" in err


def test_f6_resume_refuses_another_device_kind(done_run, capsys, tmp_path):
    src, out, ids, args = done_run
    job = json.loads((out / "_job.json").read_text())
    assert job["compute"] == {"device": "cpu", "dtype": "float32"}  # auto, resolved
    copy = tmp_path / "out"
    copy.mkdir()
    for name, data in snapshot(out).items():
        (copy / name).write_bytes(data)
    (copy / "_job.json").write_text(json.dumps({**job, "compute": {"device": "cuda",
                                                                   "dtype": "bfloat16"}}))
    code, err = score(capsys, src, copy, *args[2:], "--resume")
    assert code == 2 and "scored on cuda in bfloat16" in err and "--allow-device-change" in err
    assert "_SUCCESS" in os.listdir(copy)
    code, err = score(capsys, src, copy, *args[2:], "--resume", "--allow-device-change")
    assert code == 0 and "warning" in err
    finished(copy, ids)


def test_f7_int32_and_int64_id_files_resume(tmp_path, capsys, checkpoint, local_ray):
    d, out = tmp_path / "in", tmp_path / "out"
    d.mkdir()
    pq.write_table(pa.table({"id": pa.array(range(10), pa.int32()), "prompt": ["a b"] * 10}),
                   d / "a.parquet")
    pq.write_table(pa.table({"id": pa.array(range(10, 16), pa.int64()), "prompt": ["c"] * 6}),
                   d / "b.parquet")
    args = [d, out, "--model", checkpoint, *SMALL_PARTS]
    assert score(capsys, *args)[0] == 0
    assert {pq.read_schema(out / p).field("id").type for p in parts(out)} == {pa.int64()}
    os.remove(out / parts(out)[0])  # as if the job had been killed before that part
    code, err = score(capsys, *args, "--resume")
    assert code == 0, err
    finished(out, list(range(16)))


def test_f9_a_stopped_scoring_actor_is_killed_and_its_batch_retried(tmp_path, checkpoint,
                                                                    local_ray):
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    stopped = {}
    args = [src, out, "--model", checkpoint, *SMALL_PARTS, "--batch-timeout-s", "5"]
    with running_job(tmp_path / "driver.log", args, local_ray, n=160) as (job, ids):  # rows left to stop it in
        actor = next(a for a in alive_pipeline_actors(local_ray) if "ScoringActor" in a.class_name)
        os.kill(actor.pid, signal.SIGSTOP)
        stopped["pid"] = actor.pid
        assert job.wait(timeout=300) == 0
    _, metrics = finished(out, ids)
    assert metrics["actors"][0]["restarts"] == 1 and stopped["pid"] in metrics["actors"][0]["pids"]
    assert "past --batch-timeout-s 5; killing actor process" in (tmp_path / "driver.log").read_text()


def test_f9_resources_ray_cannot_give_are_refused(tmp_path, capsys, local_ray):
    src = tmp_path / "in.parquet"
    write_input(src, 2)
    t0 = time.time()
    code, err = score(capsys, src, tmp_path / "out", "--gpus-per-replica", "0.5")
    assert code == 2 and "0.5 GPU (1 replica(s) x 0.5) but Ray sees 0" in err
    assert "--wait-for-resources" in err and time.time() - t0 < 60
    assert not parts(tmp_path / "out")


def test_f10_sigterm_is_handled_like_sigint_and_resume_finishes(tmp_path, checkpoint, local_ray):
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    args = [src, out, "--model", checkpoint, *SMALL_PARTS]
    with running_job(tmp_path / "driver.log", args, local_ray) as (job, ids):
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=120) == 143
    assert "dsv4batch: terminated (SIGTERM)" in (tmp_path / "driver.log").read_text()
    assert not (out / "_lease.json").exists()  # released on the way out
    wait_for(lambda: not alive_pipeline_actors(local_ray), "the stopped job's actors", 120)
    assert main([*map(str, args), "--resume"]) == 0
    finished(out, ids)


def test_f10_a_refusal_after_ray_started_leaves_output_reusable(tmp_path, capsys, checkpoint,
                                                               local_ray):
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    pq.write_table(pa.table({"id": [1, 1, 2], "prompt": ["a", "b", "c"]}), src)
    code, err = score(capsys, src, out, "--model", checkpoint, *SMALL_PARTS)
    assert code == 2 and "on more than one row" in err  # found by the id scan, on Ray
    pq.write_table(pa.table({"id": [1, 3, 2], "prompt": ["a", "b", "c"]}), src)
    assert score(capsys, src, out, "--model", checkpoint, *SMALL_PARTS)[0] == 0  # no flag
    finished(out, [1, 3, 2])


def test_f10_output_inside_input_resumes(tmp_path, capsys, checkpoint, local_ray):
    d = tmp_path / "data"
    d.mkdir()
    ids = write_input(d / "in.parquet", 12, with_ids=False)
    args = [d, d / "scores", "--model", checkpoint, *SMALL_PARTS]
    assert score(capsys, *args)[0] == 0
    code, err = score(capsys, *args, "--resume")
    assert code == 0, err
    finished(d / "scores", ids)


def test_f11_rows_per_file_is_exact_and_metrics_add_up(tmp_path, capsys, checkpoint, local_ray):
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    ids = write_input(src, 50)
    assert score(capsys, src, out, "--model", checkpoint, *FAST, "--batch-size", "32",
                 "--rows-per-file", "20")[0] == 0
    sizes = sorted(pq.ParquetFile(out / p).metadata.num_rows for p in parts(out))
    assert max(sizes) <= 20 and sum(sizes) == 50, sizes
    _, metrics = finished(out, ids)
    assert metrics["total"] == {**metrics["total"], "num_runs": 1, "rows": 50}
