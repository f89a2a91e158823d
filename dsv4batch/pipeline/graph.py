"""The Ray Data graph: Tokenize (CPU actors) -> replica actors, as a composable Python API.

    ds = ray.data.read_parquet(...)                 # any Dataset with the configured columns
    scores = dsv4batch.pipeline.score(ds, ScoreConfig(replicas=2))
    texts = dsv4batch.pipeline.generate(ds, GenerateConfig(max_tokens=64))
    scores.write_parquet(...)                       # or more Ray Data steps

`score_tokenized` / `generate_tokenized` are the same graphs for requests that are token ids
already (the lm-eval backend tokenizes itself): they start at the replica actor pool.

Each input row comes out exactly once: every step keeps row count and order within a batch,
and a row that cannot be processed carries an `error` instead of being dropped.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from dsv4batch.jobspec import schema as S
from dsv4batch.jobspec.config import GenerateConfig, JobConfig, ScoreConfig
from dsv4batch.jobspec.errors import UsageError


def resolve(config: JobConfig) -> JobConfig:
    """Fill in cluster-dependent defaults and refuse resource settings that cannot run
    (`fit_to_cluster` on what Ray sees: the cluster's resources and each live node's CPUs)."""
    import ray

    cluster, node_cpus = {}, []
    if ray.is_initialized():
        cluster = ray.cluster_resources()
        node_cpus = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
    return fit_to_cluster(config, cluster, node_cpus)


# The most CPU a CPU-backend rank reserves by default. The reservation only schedules (the torch
# threads are set apart, `_torch_threads`); a small one leaves room for tokenizers and tasks.
CPU_RANK_MAX = 0.5
RAY_CPU_STEP = 1e-4  # Ray's resource granularity: a share is rounded down to it, never up


def fit_to_cluster(config: JobConfig, cluster: dict, node_cpus: list) -> JobConfig:
    """`config` with its resource defaults for a cluster with resources `cluster` (Ray's
    `cluster_resources()`, {} when unknown) and live nodes with `node_cpus` CPUs each.

    `gpus_per_replica`: 1 when the cluster has GPUs, else 0 (CPU backend). `cpus_per_replica`:
    1 with GPUs; on the CPU backend an equal share of what the tokenizers and one whole CPU leave
    (Ray Data's list/read/write tasks need 1 CPU each: a pool that takes every CPU would wait
    forever), at most `CPU_RANK_MAX` (both per rank: a --tp T replica takes T times them).
    `torch_threads` on the CPU backend: each rank's share of a node's CPUs (`_torch_threads`).
    Refused: settings that leave less than one CPU for those tasks, and replicas that need more
    GPUs or CPUs than the cluster has unless `wait_for_resources` (an autoscaler adds nodes).
    """
    gpus = config.gpus_per_replica
    if gpus is None:
        gpus = 1.0 if cluster.get("GPU", 0) > 0 else 0.0
    cpus = config.cpus_per_replica
    if cpus is None:
        cpus = 1.0 if gpus > 0 else _cpu_share(config, cluster.get("CPU", 0))
    _check_tp(config, gpus, cpus)
    _check_cpus_left(config, gpus, cpus, cluster.get("CPU", 0))
    _check_available(config, gpus, cpus, cluster)
    threads = config.torch_threads
    if threads is None and gpus == 0:
        threads = _torch_threads(config.replicas * config.tp, node_cpus)
    resolved = {"gpus_per_replica": gpus, "cpus_per_replica": cpus, "torch_threads": threads}
    changes = {k: v for k, v in resolved.items() if getattr(config, k) != v}
    return config.replace(**changes) if changes else config


def _cpu_share(config: JobConfig, total: float) -> float:
    """A CPU-backend rank's default reservation on a cluster of `total` CPUs (0: unknown)."""
    free = total - 1 - config.tokenize_concurrency * config.tokenize_num_cpus
    if not total or free <= 0:  # unknown, or nothing fits (refused by `_check_cpus_left`)
        return CPU_RANK_MAX
    share = math.floor(free / (config.replicas * config.tp) / RAY_CPU_STEP) * RAY_CPU_STEP
    return min(CPU_RANK_MAX, max(RAY_CPU_STEP, share))


def _torch_threads(ranks: int, node_cpus: list) -> int | None:
    """Intra-op threads of a CPU-backend rank: its share of a node's CPUs, the `ranks` spread
    evenly over the nodes that have CPUs, the smallest node counted (at least 1). Ray's own
    default is one thread for a fractional-CPU actor: one core of a laptop. None: no node known
    (Ray's default stays)."""
    nodes = [c for c in node_cpus if c > 0]
    if not nodes:
        return None
    per_node = math.ceil(ranks / len(nodes))
    return max(1, int(min(nodes) // per_node))


def _check_tp(config: JobConfig, gpus: float, cpus: float) -> None:
    if config.tp > 1 and gpus not in (0, 1):
        raise UsageError(f"--tp {config.tp} puts one rank on one GPU: --gpus-per-replica (per rank) "
                         f"must be 1 or 0 (the CPU backend), got {gpus:g}")
    if config.tp > 1 and gpus == 0 and cpus <= 0:
        raise UsageError(f"--tp {config.tp} on the CPU backend needs --cpus-per-replica > 0 per rank")


def _per(config: JobConfig) -> str:
    return f"{config.replicas} replica(s)" + (f" x {config.tp} ranks" if config.tp > 1 else "")


def _check_cpus_left(config: JobConfig, gpus: float, cpus: float, total: float) -> None:
    """On the CPU backend the actors must leave one whole CPU for Ray Data's tasks."""
    need = config.replicas * config.tp * cpus + config.tokenize_concurrency * config.tokenize_num_cpus
    if gpus == 0 and total and need > total - 1 + 1e-9:
        raise UsageError(
            f"{_per(config)} x {cpus:g} CPU + {config.tokenize_concurrency} "
            f"tokenizer(s) x {config.tokenize_num_cpus:g} CPU leave less than 1 of the cluster's "
            f"{total:g} CPUs for read/write tasks; lower --replicas, --tp, --cpus-per-replica "
            "or the tokenizers' --tokenize-concurrency / --tokenize-num-cpus")


def _check_available(config: JobConfig, gpus: float, cpus: float, cluster: dict) -> None:
    """Replicas that need more GPUs or CPUs than Ray sees: refused, or a warning with
    `wait_for_resources`."""
    ranks = config.replicas * config.tp
    short = [f"{ranks * n:g} {kind} ({_per(config)} x {n:g}) but Ray "
             f"sees {cluster.get(kind, 0):g}" for kind, n in (("GPU", gpus), ("CPU", cpus))
             if n > 0 and cluster and ranks * n > cluster.get(kind, 0)]
    if short and not config.wait_for_resources:
        raise UsageError(f"the replicas need {'; '.join(short)}: the run would wait forever "
                         "without an autoscaler. Lower --replicas / --gpus-per-replica / "
                         "--cpus-per-replica, or pass --wait-for-resources when an autoscaler "
                         "adds nodes")
    if short:
        import logging

        logging.getLogger(__name__).warning("the replicas need %s; waiting for an autoscaler "
                                            "to add nodes", "; ".join(short))


# GiB per GPU of the accelerator types Ray labels nodes with (`accelerator_type:<name>`)
GPU_MEMORY_GIB = {"H200": 141, "H100": 80, "B200": 180, "A100-80G": 80, "A100-40G": 40,
                  "L40S": 48, "L4": 24, "A10G": 24}


def check_capacity(config: JobConfig, cluster: dict, log) -> None:
    """Refuse, before any actor starts, a GPU replica whose ranks `dsv4batch plan` says cannot
    fit (weights split `config.tp` ways, one GPU per rank). `cluster`: Ray's resources."""
    if not config.gpus_per_replica:
        return
    gib = config.gpu_memory_gib
    if gib is None:
        known = [GPU_MEMORY_GIB[k.split(":", 1)[1]] for k in cluster
                 if k.startswith("accelerator_type:") and k.split(":", 1)[1] in GPU_MEMORY_GIB]
        if not known:
            log("[dsv4batch] note: GPU memory unknown (give --gpu-memory-gib): no capacity check")
            return
        gib = min(known)
    from dsv4batch.model.capacity import replica_fits

    fits, why = replica_fits(config.model, config.tp, int(gib * 2**30), config.max_model_len,
                             config.max_batched_tokens, dtype=config.compute()["dtype"],
                             weights=config.weights_dtype)
    if not fits:
        gpus = "one" if config.tp == 1 else str(config.tp)
        raise UsageError(f"model {config.model!r} does not fit {gpus} {gib:g} GiB GPU"
                         f"{'' if config.tp == 1 else 's'} per replica ({why}); see "
                         f"`dsv4batch plan --model {config.model}`")


def _check_schema(dataset, needed) -> None:
    """The dataset's columns, when Ray knows them without running anything, include `needed`."""
    try:
        schema = dataset.schema(fetch_if_missing=False)
    except Exception:
        schema = None
    if schema is not None:
        S.check_columns("read", needed, list(schema.names), "dataset")


def score(dataset, config: ScoreConfig, *, stats: Any = None, scorer: type | None = None):
    """Append the scoring steps to `dataset`; returns a lazy `ray.data.Dataset` of scores.

    `dataset` needs `config.text_column`, `config.id_column` (unique ids), the target and keep
    columns when configured. `stats`: the `StatsCollector` actor handle for throughput and the
    batch ledger; one is started when none is given (then `max_errored_rows` None: no limit).
    The dataset's DataContext gets the fault settings of `faults.fault_settings`,
    `config.max_block_mib` as its largest block and `config.buffer_bytes()` as its object store
    budget. `scorer`: the scoring step class, `ScoringActor` or a subclass (bench/stream.py swaps
    the model out).
    """
    return process(dataset, _task(config, ScoreConfig), stats=stats, actor=scorer)


def generate(dataset, config: GenerateConfig, *, stats: Any = None, generator: type | None = None):
    """Append the generation steps to `dataset`; returns a lazy `ray.data.Dataset` with one
    generated row per input row (`schema.generate_schema`). `dataset` needs
    `config.text_column`, `config.id_column`, the sampling parameters and keep columns when
    configured; `stats` and the DataContext as `score`; `generator`: `GenerateActor` or a subclass."""
    return process(dataset, _task(config, GenerateConfig), stats=stats, actor=generator)


def process(dataset, config: JobConfig, *, stats: Any = None, actor: type | None = None):
    """Tokenize (CPU actors) -> the replica actors of `config.task` (`actor`: their class)."""
    from ray.data import ActorPoolStrategy

    from dsv4batch.pipeline.stages.tokenize import Tokenize

    config, stats = _prepare(dataset, config, stats)
    _check_schema(dataset, Tokenize.spec(config).reads)
    tokenized = dataset.map_batches(
        Tokenize, fn_constructor_kwargs={"config": config, "stats": stats},
        compute=ActorPoolStrategy(min_size=1, max_size=config.tokenize_concurrency),
        batch_format="pyarrow", batch_size=config.tokenize_batch_size,
        num_cpus=config.tokenize_num_cpus, zero_copy_batch=True, udf_modifying_row_count=False)
    return _replicas(tokenized, config, stats, actor)


def _task(config, cls):
    if not isinstance(config, cls):
        raise UsageError(f"config must be a {cls.__name__}, got {type(config).__name__}")
    return config


def score_tokenized(dataset, config: ScoreConfig, *, stats: Any = None,
                    scorer: type | None = None):
    """`score` for requests tokenized already (the lm-eval backend's): no Tokenize step.

    `dataset` columns: `id` (unique), `schema.INPUT_IDS` (list<int32>: the whole request, at
    most `max_model_len` ids), `schema.NUM_SCORED` (int32: how many trailing ids are scored,
    >= 1 unless the request is a single id) and `error` (string, null for a request to score);
    with `truncate` other than none also `schema.NUM_TRUNCATED`. Returns one output row per
    request, as `score` does (`config.text_column` etc. are not used).
    """
    from dsv4batch.actors.score import ScoringActor

    config, stats = _prepare(dataset, config, stats)
    _check_schema(dataset, ScoringActor.spec(config).reads)
    return _replicas(dataset, config, stats, scorer)


def generate_tokenized(dataset, config: GenerateConfig, *, stats: Any = None,
                       generator: type | None = None):
    """`generate` for prompts tokenized already (the lm-eval backend's): no Tokenize step.

    `dataset` columns: `id` (unique), `schema.INPUT_IDS` (list<int32>: the prompt ids fed as
    they are, no bos added), `error` (string, null for a request to generate) and, when
    `config.sampling_params_column` is set, that column (a JSON object per row over the
    config's sampling options; give each row its `seed` to make it independent of the run's).
    Returns one output row per request, as `generate` does.
    """
    from dsv4batch.actors.generate import GenerateActor

    config, stats = _prepare(dataset, _task(config, GenerateConfig), stats)
    _check_schema(dataset, GenerateActor.spec(config).reads)
    return _replicas(dataset, config, stats, generator)


def _prepare(dataset, config: JobConfig, stats):
    """Resolve `config`, set the dataset's context (faults, block size, buffer), get `stats`."""
    from dsv4batch.pipeline.faults import fault_settings
    from dsv4batch.pipeline.metrics import start_collector

    _task(config, JobConfig)
    config = resolve(config)
    fault_settings(dataset.context)
    # both apply to every step of this dataset, the read included (Ray reads them at execution)
    dataset.context.target_max_block_size = int(config.max_block_mib * 2**20)
    options = dataset.context.execution_options
    options.resource_limits = options.resource_limits.copy(
        object_store_memory=config.buffer_bytes())
    if stats is None:
        stats = start_collector(config.max_errored_rows)
    return config, stats


def _replicas(tokenized, config: JobConfig, stats, actor):
    """The pool of replica actors (`actor`, default the task's: `ScoringActor` or
    `GenerateActor`) over a tokenized dataset. With --tp > 1 an actor only coordinates (no CPU or
    GPU reserved): its `ShardedEngine` places the ranks in a placement group."""
    from ray.data import ActorPoolStrategy

    from dsv4batch.actors.generate import GenerateActor
    from dsv4batch.actors.score import ScoringActor

    if actor is None:
        actor = GenerateActor if config.task == "generate" else ScoringActor
    # blocks of batch_size rows: every actor call is one batch and batches spread over replicas
    tokenized = tokenized.repartition(target_num_rows_per_block=config.batch_size)
    sharded = config.tp > 1
    with warnings.catch_warnings():
        # Ray 2.60 takes max_restarts/max_task_retries only as **ray_remote_args (deprecated,
        # with no named replacement yet); they are set explicitly, not left to Ray Data's
        # defaults, because its max_restarts=-1 restarts an actor that dies while loading the
        # model forever. Task retries are unbounded: the ledger answers a batch itself once it
        # used max_batch_attempts.
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        return tokenized.map_batches(
            actor,
            fn_constructor_kwargs={"config": config, "stats": stats,
                                   "num_gpus": config.gpus_per_replica},
            compute=ActorPoolStrategy(size=config.replicas,
                                      max_tasks_in_flight_per_actor=config.batches_in_flight),
            num_gpus=0 if sharded else config.gpus_per_replica,
            num_cpus=0 if sharded else config.cpus_per_replica,
            batch_size=config.batch_size, batch_format="pyarrow", zero_copy_batch=True,
            udf_modifying_row_count=False, max_restarts=config.max_actor_restarts,
            max_task_retries=-1)
