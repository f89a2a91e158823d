import json
import os

import pyarrow.parquet as pq
import pytest

# fractional CPUs so read/tokenize/write tasks are never starved on 2 cores; small part files,
# so a run writes several (the fault tests act when the first one appears)
FAST = ["--cpus-per-replica", "0.5", "--tokenize-num-cpus", "0.25", "--tokenize-concurrency", "1",
        "--batch-size", "4", "--tokenize-batch-size", "8", "--rows-per-file", "8", "--no-progress"]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """A transformers save_pretrained DSv4 checkpoint with the real tokenizer's vocabulary."""
    from tests.model_factory import make_hf_checkpoint

    path = tmp_path_factory.mktemp("ckpt")
    make_hf_checkpoint(str(path), seed=0, vocab_size=129280)
    return str(path)


@pytest.fixture(scope="module")
def local_ray(request):
    """One local Ray for the test module (never another module's); its GCS address.

    A module that sets `RAY_DASHBOARD = True` gets the dashboard (on 127.0.0.1), which
    `ray.util.state` needs."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    dashboard = getattr(request.module, "RAY_DASHBOARD", False)
    ray.init(address="local", num_cpus=2, include_dashboard=dashboard, dashboard_host="127.0.0.1",
             logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


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
