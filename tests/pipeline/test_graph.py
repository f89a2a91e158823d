"""Streaming granularity: `score()` gives the dataset (its read included) blocks of at most
`max_block_mib` and an object store budget of `buffer_bytes()`.

Ray's Parquet reader packs small files and row groups into one read task and ignores
`override_num_blocks`; with Ray's 128 MiB default block, a whole dataset of short prompts was
one block, held at once by a tokenize actor (its memory grew with the input).
"""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsv4batch.jobspec.config import ScoreConfig
from dsv4batch.pipeline.graph import score
from dsv4batch.pipeline.read import inspect_input, read


pytestmark = pytest.mark.usefixtures("local_ray")  # one local Ray for this module


def test_read_blocks_follow_max_block_mib(tmp_path):
    rng = np.random.default_rng(0)
    for f in range(3):
        ids = np.arange(f * 4000, (f + 1) * 4000)
        texts = [" ".join(["word"] * int(n)) for n in rng.integers(3, 12, len(ids))]
        pq.write_table(pa.table({"id": ids, "prompt": texts}), tmp_path / f"part-{f}.parquet")
    config = ScoreConfig(input=str(tmp_path), output=str(tmp_path / "out"),
                         max_block_mib=1 / 16, max_buffered_mib=3)
    ds = read(config, inspect_input(config.input))
    score(ds, config)  # lazy: sets the dataset's context, runs nothing
    assert ds.context.target_max_block_size == 2**16
    assert ds.context.execution_options.resource_limits.object_store_memory == 3 * 2**20

    metas = [m for bundle in ds.iter_internal_ref_bundles() for m in bundle.metadata]
    assert sum(m.num_rows for m in metas) == 12_000
    assert len(metas) >= 6  # ~40 bytes a row: 12k rows are ~0.5 MiB, 8+ blocks of 64 KiB
    assert max(m.size_bytes for m in metas) <= 2 * 2**16


def test_buffer_default_scales_with_replicas():
    assert ScoreConfig().buffer_bytes() == (4 * 4 + 16) * 2**20
    assert ScoreConfig(replicas=8, max_block_mib=2).buffer_bytes() == (8 + 128) * 2**20


def test_capacity_check_refuses_a_replica_that_cannot_fit():
    from dsv4batch.jobspec.errors import UsageError
    from dsv4batch.pipeline.graph import check_capacity

    notes = []
    gpu = ScoreConfig(gpus_per_replica=1.0)
    check_capacity(gpu, {"GPU": 8, "accelerator_type:H200": 1}, notes.append)  # tiny fits
    check_capacity(ScoreConfig(gpus_per_replica=0.0), {}, notes.append)  # CPU: no check
    check_capacity(gpu, {"GPU": 8}, notes.append)  # unknown GPU: a note, no check
    assert notes == ["[dsv4batch] note: GPU memory unknown (give --gpu-memory-gib): no "
                     "capacity check"]
    with pytest.raises(UsageError, match=r"does not fit one 0.01 GiB GPU per replica"):
        check_capacity(gpu.replace(gpu_memory_gib=0.01), {"GPU": 8}, notes.append)
