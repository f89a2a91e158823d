import json
import os

import pyarrow.parquet as pq
import pytest

# small and fast: fractional CPUs so read/tokenize/write tasks are never starved on 2 cores
FAST = ["--cpus-per-replica", "0.5", "--tokenize-num-cpus", "0.25", "--batch-size", "4",
        "--tokenize-batch-size", "8", "--no-progress"]

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


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """A transformers save_pretrained DSv4 checkpoint with the real tokenizer's vocabulary."""
    from tests.model_factory import make_hf_checkpoint

    path = tmp_path_factory.mktemp("ckpt")
    make_hf_checkpoint(str(path), seed=0, vocab_size=129280)
    return str(path)


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
