"""Two worker nodes with two logical GPUs each: `--replicas 2 --gpus-per-replica 2` puts one
scoring actor on each node (CPU backend: there is no CUDA here) and every row is scored once."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsv4batch.jobs.score import main
from tests.jobs.conftest import GPUS_PER_NODE, TEXTS, gpu_nodes, read_output


@pytest.fixture(scope="module")
def cluster(gpu_cluster):
    return gpu_nodes(gpu_cluster)


def test_one_actor_per_gpu_node(tmp_path, checkpoint, cluster):
    c, worker_ids = cluster
    texts = [t for t in TEXTS if t] * 3
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [f"row-{i}" for i in range(len(texts))], "prompt": texts}), src)
    out = tmp_path / "out"
    assert main([str(src), str(out), "--model", checkpoint, "--ray-address", c.address,
                 "--replicas", "2", "--gpus-per-replica", str(GPUS_PER_NODE), "--cpus-per-replica", "0.25",
                 "--tokenize-num-cpus", "0.25", "--batch-size", "2", "--no-progress"]) == 0
    table, metrics = read_output(out)
    assert sorted(table["id"].to_pylist()) == sorted(f"row-{i}" for i in range(len(texts)))
    assert table["error"].null_count == table.num_rows
    actors = metrics["actors"]
    assert metrics["num_actors"] == 2 and {a["node_id"] for a in actors} == worker_ids
    assert all(a["device"] == "cpu" and a["rows"] > 0 for a in actors)
    assert sum(a["rows"] for a in actors) == len(texts) and metrics["gpus_per_replica"] == GPUS_PER_NODE
