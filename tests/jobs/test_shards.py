"""`dsv4batch score --tp 2` end to end on a `ray.cluster_utils.Cluster` of two nodes with two
logical GPUs each (the ranks run on CPU with gloo: there is no CUDA here): two replicas, each in
its own placement group on one node; a rank killed mid-job; a model that cannot be split."""

import os
import signal
import threading

import pytest

from dsv4batch.jobs.score import main
from tests.jobs.conftest import FAST, finished, gpu_nodes, parts, wait_for, write_input

TP2 = ["--tp", "2", "--gpus-per-replica", "1", "--cpus-per-replica", "0.25", "--tokenize-concurrency", "1",
       "--collective-timeout-s", "60"]


@pytest.fixture(scope="module")
def cluster(gpu_cluster):
    return gpu_nodes(gpu_cluster)


def rank_pids() -> list[int]:
    """Processes of live rank workers on this machine (every node of the Cluster is local)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::RankWorker"):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_two_tp2_replicas_each_on_one_node(tmp_path, checkpoint, cluster):
    c, worker_ids = cluster
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    ids = write_input(src, 24)
    assert main([str(src), str(out), "--model", checkpoint, "--ray-address", c.address, "--replicas", "2",
                 *TP2, *FAST]) == 0
    rows, metrics = finished(out, ids)
    assert all(r["error"] is None for r in rows.values())
    actors = metrics["actors"]
    # both replicas start and report their ranks; which one scores how many of the 6 batches is
    # Ray Data's dispatch (a replica ready first may take them all), so only the sum is fixed
    assert metrics["num_actors"] == 2 and metrics["tp"] == 2 and sum(a["rows"] for a in actors) == 24
    nodes = [{r["node_id"] for r in a["ranks"]} for a in actors]
    assert all(len(n) == 1 for n in nodes)  # PACK: a replica's two ranks share a node
    assert set().union(*nodes) == worker_ids  # and the two replicas use both GPU nodes
    assert all(len(a["ranks"]) == 2 and {r["rank"] for r in a["ranks"]} == {0, 1} for a in actors)
    assert all(a["head_precision"] == "fp32" and {r["head_precision"] for r in a["ranks"]} == {"fp32"}
               for a in actors)
    assert all(a["attn_kernel"] == "cpu" and {r["attn_kernel"] for r in a["ranks"]} == {"cpu"} for a in actors)
    assert not any(n.startswith("dsv4batch-replica") for n in placement_group_names())


def placement_group_names() -> list[str]:
    from ray.util.placement_group import placement_group_table

    return [e["name"] for e in placement_group_table().values() if e["state"] != "REMOVED"]


def test_a_killed_rank_is_restarted_and_the_job_completes(tmp_path, checkpoint, cluster):
    c, _ = cluster
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    ids = write_input(src, 48)
    killed = {}

    def kill_one_rank():
        try:
            wait_for(lambda: parts(out), "the first part file")
            pid = rank_pids()[-1]
            killed.update(pid=pid, parts=len(parts(out)))
            os.kill(pid, signal.SIGKILL)
        except Exception as exc:  # noqa: BLE001 - reported by the test below
            killed["error"] = exc

    killer = threading.Thread(target=kill_one_rank, daemon=True)
    killer.start()
    assert main([str(src), str(out), "--model", checkpoint, "--ray-address", c.address, *TP2, *FAST,
                 "--rows-per-file", "8"]) == 0
    killer.join(timeout=10)
    assert "error" not in killed and "pid" in killed, killed
    rows, metrics = finished(out, ids)  # every id exactly once
    assert all(r["error"] is None for r in rows.values())  # the failed batch was retried
    assert len(parts(out)) > killed["parts"]  # the kill came while the job still had work
    assert metrics["faults"]["retried_batches"] >= 1


def test_a_model_that_cannot_be_split_is_refused_before_any_actor(tmp_path, checkpoint, capsys):
    src = tmp_path / "in.parquet"
    write_input(src, 4)
    # the test checkpoint has 2 output groups: 4 ranks cannot split them (checked before Ray)
    assert main([str(src), str(tmp_path / "out"), "--model", checkpoint, "--tp", "4", *FAST]) == 2
    err = capsys.readouterr().err
    assert "o_groups 2 is not divisible by tp 4" in err and "--tp 4" in err
    assert not os.path.exists(tmp_path / "out")
