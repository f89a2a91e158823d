"""CPU-backend resource defaults sized to the cluster (`graph.fit_to_cluster`, no Ray): the
scoring ranks together use a node's cores (torch threads), their reservations leave one whole
CPU for Ray Data's read/write tasks, and only what cannot run is refused."""

import pytest

from dsv4batch.jobspec.config import ScoreConfig
from dsv4batch.jobspec.errors import UsageError
from dsv4batch.pipeline.graph import fit_to_cluster


def node(cpus: float, gpus: float = 0) -> tuple[dict, list]:
    """(cluster resources, node CPUs) of one node."""
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}, [cpus]


def fitted(config: ScoreConfig, cluster: tuple) -> tuple:
    got = fit_to_cluster(config, *cluster)
    return got.gpus_per_replica, got.cpus_per_replica, got.torch_threads


def test_one_replica_on_two_cores_uses_both():
    # 0.5 + 2 tokenizers x 0.25 leave 1 CPU for reads; torch runs 2 threads, not Ray's 1
    assert fitted(ScoreConfig(), node(2)) == (0.0, 0.5, 2)
    assert fitted(ScoreConfig(), node(16)) == (0.0, 0.5, 16)


def test_ranks_and_replicas_share_the_cores_and_the_cpus_left():
    # --tp 2 on 2 cores: 0.25 per rank fits (refused before: 2 x 0.5 + 0.5 > 2 - 1), 1 thread each
    assert fitted(ScoreConfig(tp=2), node(2)) == (0.0, 0.25, 1)
    assert fitted(ScoreConfig(replicas=2), node(2)) == (0.0, 0.25, 1)
    assert fitted(ScoreConfig(replicas=2, tp=2), node(16)) == (0.0, 0.5, 4)
    # a share Ray cannot hold exactly is rounded down to its granularity, so the sum still fits
    gpus, cpus, threads = fitted(ScoreConfig(replicas=3), node(2))
    assert cpus == pytest.approx(0.1666) and 3 * cpus + 0.5 <= 1 and threads == 1


def test_threads_count_the_ranks_per_node_of_the_smallest_node():
    cluster = {"CPU": 10}, [0, 4, 6]  # a head without CPUs and two workers
    assert fitted(ScoreConfig(replicas=2), cluster)[2] == 4
    assert fitted(ScoreConfig(replicas=4), cluster)[2] == 2
    assert fitted(ScoreConfig(replicas=16, cpus_per_replica=0.1), cluster)[2] == 1  # at least 1


def test_given_values_are_kept():
    config = ScoreConfig(cpus_per_replica=0.25, torch_threads=3)
    assert fitted(config, node(16)) == (0.0, 0.25, 3)
    assert fit_to_cluster(config.replace(gpus_per_replica=0.0), *node(16)) == \
        config.replace(gpus_per_replica=0.0)  # nothing left to fill in: the same config


def test_gpu_replicas_and_an_unknown_cluster_keep_the_old_defaults():
    assert fitted(ScoreConfig(), node(8, gpus=2)) == (1.0, 1.0, None)  # threads: Ray's default
    assert fitted(ScoreConfig(), ({}, [])) == (0.0, 0.5, None)  # the Python API before Ray


def test_only_what_cannot_run_is_refused():
    with pytest.raises(UsageError, match="leave less than 1 of the cluster's 2 CPUs"):
        fit_to_cluster(ScoreConfig(replicas=2, cpus_per_replica=0.5), *node(2))
    with pytest.raises(UsageError, match="leave less than 1 of the cluster's 1 CPUs"):
        fit_to_cluster(ScoreConfig(), *node(1))  # a read task needs the only CPU
    with pytest.raises(UsageError, match="leave less than 1 of the cluster's 2 CPUs"):
        fit_to_cluster(ScoreConfig(tokenize_concurrency=4, tokenize_num_cpus=0.5), *node(2))
    with pytest.raises(UsageError, match=r"8 CPU \(2 replica\(s\) x 4\) but Ray sees 6"):
        fit_to_cluster(ScoreConfig(replicas=2, cpus_per_replica=4.0, gpus_per_replica=1.0),
                       {"CPU": 6, "GPU": 2}, [6])
