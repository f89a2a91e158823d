"""Helpers of the end-to-end job tests: fast flags and checks of a finished OUTPUT."""

import json
import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

# small and fast: fractional CPUs so read/tokenize/write tasks are never starved on 2 cores;
# one torch thread per actor (the tests check values: tests/threads.py)
FAST = ["--cpus-per-replica", "0.5", "--tokenize-num-cpus", "0.25", "--batch-size", "4",
        "--tokenize-batch-size", "8", "--torch-threads", "1", "--no-progress"]
# one tokenizer and small part files, so a run writes several (the fault tests act when the
# first one appears)
SMALL_PARTS = [*FAST, "--tokenize-concurrency", "1", "--rows-per-file", "8"]

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ray Data streams blocks of rows between tasks and actors.",
    "",
    None,
    "Offline batch scoring reads Parquet and writes Parquet.",
    "Each row comes out exactly once.",
    "A slightly longer sentence, so that requests differ in length by a few tokens at least.",
    "Short.",
    "Token-level log-probabilities are summed into a log-likelihood per row.",
    "The last row.",
]


def read_output(out) -> tuple:
    """(table of all part files, metrics) after checking the folder holds only finished files."""
    names = sorted(os.listdir(out))
    assert not [n for n in names if n.startswith("_tmp-")], names
    assert "_SUCCESS" in names and "_metrics.json" in names and "_job.json" in names
    table = pq.read_table(str(out))
    with open(os.path.join(out, "_metrics.json")) as f:
        metrics = json.load(f)
    ids = table["id"].to_pylist()
    assert len(ids) == len(set(ids)), "duplicate ids in the output"
    assert metrics["rows"] == table.num_rows
    return table, metrics


def parts(out) -> list[str]:
    if not os.path.isdir(out):
        return []
    return sorted(n for n in os.listdir(out) if n.startswith("part-") and n.endswith(".parquet"))


def part_rows(out) -> int:
    return sum(pq.ParquetFile(os.path.join(out, n)).metadata.num_rows for n in parts(out))


def finished(out, input_ids) -> tuple:
    """(rows by id, metrics) of a finished run, after the invariant every test checks:
    only finished files, `_SUCCESS`, rows in == rows scored + rows with an error, ids unique
    and exactly the input's."""
    names = os.listdir(out)
    assert not [n for n in names if n.startswith("_tmp-")], names
    assert {"_SUCCESS", "_metrics.json", "_job.json"} <= set(names), names
    table = pq.read_table(str(out))
    ids = table["id"].to_pylist()
    assert len(ids) == len(set(ids)), "an id was written twice"
    assert sorted(ids, key=repr) == sorted(input_ids, key=repr), "rows in != rows out"
    rows = table.to_pylist()
    scored = sum(r["error"] is None and r["logprob_sum"] is not None for r in rows)
    errored = sum(r["error"] is not None and r["logprob_sum"] is None for r in rows)
    assert scored + errored == len(input_ids), "a row is neither scored nor answered with an error"
    with open(os.path.join(out, "_metrics.json")) as f:
        metrics = json.load(f)
    assert metrics["rows_in_output"] == len(input_ids)
    return {r["id"]: r for r in rows}, metrics


def nothing_scored(out) -> None:
    """A refused run: no part file and no _SUCCESS (at most the _job.json of the attempt)."""
    if os.path.exists(out):
        assert not parts(out) and "_SUCCESS" not in os.listdir(out), os.listdir(out)


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = ("Ray Data streams Parquet rows through tokenize and scoring actors into part files "
         "that are renamed only when complete so a killed job leaves nothing half written").split()


def write_input(path, n: int, with_ids: bool = True) -> list[str]:
    """n rows of short prompts; the ids the output must hold (derived ones without an id column)."""
    texts = [" ".join(WORDS[(i % 7):(i % 7) + 8 + i % 9]) for i in range(n)]
    if not with_ids:
        pq.write_table(pa.table({"prompt": texts}), path, row_group_size=16)
        return [f"{os.path.basename(path)}:{i}" for i in range(n)]
    ids = [f"row-{i}" for i in range(n)]
    pq.write_table(pa.table({"id": ids, "prompt": texts}), path, row_group_size=16)
    return ids


def wait_for(predicate, what: str, timeout: float = 300, proc=None):
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline or (proc is not None and proc.poll() is not None):
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


def alive_pipeline_actors(address: str) -> list:
    from ray.util.state import list_actors

    # the module's own cluster by address: other Ray instances may run on the same machine
    return [a for a in list_actors(address=address, filters=[("state", "=", "ALIVE")], limit=1000)
            if a.class_name.startswith("MapWorker(")]


GPUS_PER_NODE = 2  # a --tp 2 replica fits one node; a 2-GPU replica takes a whole node


@pytest.fixture(scope="session")
def gpu_cluster():
    """A `ray.cluster_utils.Cluster` for the session: a CPU head and two worker nodes with
    `GPUS_PER_NODE` logical GPUs each; (cluster, worker node ids). Logical CPUs: 2 per node, so
    1-CPU read/write tasks still fit next to the fractional actors. Modules join it through
    their own `cluster` fixture (`gpu_nodes`)."""
    from ray.cluster_utils import Cluster

    from tests.ray_head import leave

    leave()  # started as nodes of their own, never beside a live driver connection
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
    workers = [c.add_node(num_cpus=2, num_gpus=GPUS_PER_NODE) for _ in range(2)]
    c.wait_for_nodes()
    yield c, {w.node_id for w in workers}
    leave(c.address)
    c.shutdown()


def gpu_nodes(gpu_cluster):
    """`gpu_cluster` with this process joined to it as its driver."""
    from tests.ray_head import join

    join(gpu_cluster[0].address)
    return gpu_cluster
