"""A tensor-parallel replica: T rank workers in one placement group, driven by a scoring actor.

`ShardedEngine` stands in for the `Engine` inside a `ScoringActor` when `--tp T` > 1. The actor
only coordinates (it reserves nothing); its replica's resources are a placement group of T
bundles, one `RankWorker` actor per bundle (bundles per replica = TP, as ray.data.llm places a TP
vLLM replica; strategy `--placement-strategy`). The workers join one torch.distributed group
(NCCL on CUDA, gloo on CPU, `collective_timeout_s` on every collective), each loads only its
slices of the checkpoint (`model/parallel.py`), and every batch goes to all of them; rank 0
returns the scores.

The group is named after the job and the actor (`group_name`): Ray restarts a dead actor under
the same id, so its new incarnation finds and reuses its group instead of reserving a second one.
The driver removes its job's groups when the run ends (`release_groups`); Ray removes any left
when the job ends. (Ray Data's `ray_remote_args_fn` is not used: Ray 2.60 also calls it once for
an issue detector, and the extra group would hold resources all run.)

Faults: requests are validated here first, so every rank either scores or none is asked. A rank
that dies, raises or hangs (its peers' collectives time out) fails the whole call: the workers
are killed, new ones are started in the same bundles, and `ReplicaLost` (a `BatchError`) makes
Ray Data retry the batch; nothing waits forever. The scoring actor's own death takes its workers
with it (Ray kills the actors an actor owns); its restart starts new ones in the same group.
"""

from __future__ import annotations

import os
import time

from dsv4batch.actors.device import pick_device, torch_dtype
from dsv4batch.jobspec.config import JobConfig
from dsv4batch.jobspec.errors import ReplicaLost, one_line


class RankWorker:
    """One rank of a replica (a Ray actor): its slices of the model and an `Engine` over them."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.engine = rank, world, None

    def endpoint(self) -> str:
        """A `tcp://ip:port` on this node that the group's store can listen on (rank 0's)."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def setup(self, init_method: str, config: JobConfig, num_gpus: float) -> dict:
        """Join the group and load this rank's slices; returns what the rank holds."""
        import datetime

        import ray
        import torch
        import torch.distributed as dist

        from dsv4batch import kernels
        from dsv4batch.model import Engine, EngineConfig
        from dsv4batch.model.parallel import TP

        device = pick_device(num_gpus)
        if device == "cpu" and config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=init_method,
                                rank=self.rank, world_size=self.world,
                                timeout=datetime.timedelta(seconds=config.collective_timeout_s))
        t0 = time.perf_counter()
        self.engine = Engine.from_pretrained(config.model, device=device, dtype=torch_dtype(config.dtype, device),
                                             config=EngineConfig(**config.engine_kwargs()),
                                             weights=config.weights_dtype, tp=TP(self.rank, self.world),
                                             tokenizer=config.tokenizer)
        tensors = list(self.engine.model.parameters()) + list(self.engine.model.buffers())
        return {"rank": self.rank, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "device": device, "dtype": str(self.engine.model.head.weight.dtype).removeprefix("torch."),
                "head_precision": self.engine.head_precision, "attn_kernel": self.engine.attn_kernel,
                "torch_threads": torch.get_num_threads(),
                "cpu_kernels": kernels.selection() if device == "cpu" else None,
                "resident_bytes": sum(t.numel() * t.element_size() for t in tensors),
                "load_s": time.perf_counter() - t0}

    def configure(self, engine_config) -> None:
        """Score with another `EngineConfig` from now on (planner, step size, ...)."""
        self.engine.config = engine_config

    def score(self, requests: list, top_k: int):
        """`Engine.score_details` on this rank (every rank runs it); rank 0's outputs, stats."""
        outs, stats = self.engine.score_details(requests, top_k=top_k)
        return (outs if self.rank == 0 else None), stats

    def generate(self, prompts: list, params: list):
        """`Engine.generate` on this rank (every rank runs it, rank 0's tokens broadcast each
        step); rank 0's outputs, stats."""
        outs, stats = self.engine.generate(prompts, params)
        return (outs if self.rank == 0 else None), stats


class ShardedEngine:
    """`Engine.score_details` over a T-rank replica (see the module docstring).

    config: the job's config (`tp`, model, dtype, engine knobs, timeouts); num_gpus,
    num_cpus: each rank's share of its bundle. `ranks`: each rank's `RankWorker.setup` info
    (pid, node, resident bytes). `placement_group`: the group the ranks run in, the actor's
    own (captured) one, else one created here (removed by `close`).
    """

    def __init__(self, config: JobConfig, num_gpus: float, num_cpus: float):
        import ray
        from ray.util.placement_group import get_placement_group, placement_group

        from dsv4batch.model.config import TINY, load_config

        self.config, self.num_gpus, self.num_cpus = config, num_gpus, num_cpus
        if config.model == TINY:
            from dsv4batch.model.tiny import tiny_config

            self.model_config = tiny_config()
        else:
            self.model_config = load_config(config.model)
        ctx = ray.get_runtime_context()
        name = group_name(ctx.get_job_id(), ctx.get_actor_id()) if ctx.get_actor_id() else None
        try:  # a restarted actor: its group is still there
            self.placement_group = get_placement_group(name) if name else None
        except ValueError:
            self.placement_group = None
        if self.placement_group is None:
            bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
            self.placement_group = placement_group([dict(bundle) for _ in range(config.tp)],
                                                   strategy=config.placement_strategy, name=name or "")
        self.own_group = name is None  # outside an actor (direct use, tests): `close` removes it
        self.workers, self.ranks, self.engine_config = [], [], None
        self.restarts = 0
        self.start()

    @property
    def head_precision(self) -> str:
        """`Engine.head_precision` of the ranks (rank 0's; the ranks' own are in `ranks`)."""
        return self.ranks[0]["head_precision"]

    @property
    def attn_kernel(self) -> str:
        """`Engine.attn_kernel` of the ranks (rank 0's; the ranks' own are in `ranks`)."""
        return self.ranks[0]["attn_kernel"]

    def start(self) -> None:
        """Start T workers, one per bundle, join their group and load the slices."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        worker = ray.remote(RankWorker)
        self.workers = [worker.options(
            num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=i),
        ).remote(i, self.config.tp) for i in range(self.config.tp)]
        timeout = self.config.batch_timeout_s
        try:
            init = ray.get(self.workers[0].endpoint.remote(), timeout=timeout)
            self.ranks = wait_all([w.setup.remote(init, self.config, self.num_gpus) for w in self.workers], timeout)
            if self.engine_config is not None:  # a restart keeps what `configure` set
                wait_all([w.configure.remote(self.engine_config) for w in self.workers], timeout)
        except ray.exceptions.RayTaskError as exc:
            self.stop()
            # a rank's own error (the loader's ModelLoadError, ...), by its type, not Ray's wrapper
            raise (exc.cause if isinstance(exc.cause, Exception) else exc) from None
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Kill the workers (their torch.distributed group dies with them; the bundles stay)."""
        import ray

        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []

    def close(self) -> None:
        self.stop()
        if self.own_group:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.own_group = False

    def configure(self, engine_config) -> None:
        """Every rank scores with `engine_config` (a `model.EngineConfig`) from now on."""
        self.engine_config = engine_config
        wait_all([w.configure.remote(engine_config) for w in self.workers], self.config.batch_timeout_s)

    def score_details(self, batch, top_k: int = 0):
        """`Engine.score_details(batch, top_k)` across the ranks: (outputs, rank 0's `StepStats`).
        `ValueError` for a bad request (before any rank sees it); `ReplicaLost` when a rank fails."""
        if not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k must be a non-negative int, got {top_k!r}")
        return self._call("score", self._valid(batch), top_k)

    def generate(self, prompts, params):
        """`Engine.generate(prompts, params)` across the ranks: (outputs, rank 0's `StepStats`).
        `ValueError` for a bad request (before any rank sees it); `ReplicaLost` when a rank fails."""
        from dsv4batch.model.generate import validate_generation
        from dsv4batch.model.sampling import SamplingParams

        requests = self._valid(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(requests)
        validate_generation(requests, params, self.model_config.vocab_size, self._max_len)
        return self._call("generate", requests, list(params))

    @property
    def _max_len(self) -> int:
        return (self.engine_config or self.config).max_model_len

    def _valid(self, batch) -> list:
        from dsv4batch.model.engine import validate

        return [a.tolist() for a in validate(batch, self.model_config.vocab_size, self._max_len)]

    def _call(self, method: str, *args):
        """Every rank runs `RankWorker.<method>(*args)`; rank 0's result."""
        if not self.workers:  # the last restart failed: try again now
            try:
                self.start()
            except Exception as exc:
                raise ReplicaLost(f"the tp={self.config.tp} replica has no ranks: starting them failed "
                                  f"({one_line(exc)})") from exc
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        try:
            # before the scoring actor's watchdog (batch_timeout_s): a hung rank restarts the
            # ranks, not the actor
            results = wait_all(refs, 0.9 * self.config.batch_timeout_s)
        except Exception as exc:
            self._restart(exc)
        outs, stats = results[0]
        return outs, stats

    def _restart(self, cause: BaseException) -> None:
        """New workers in the same bundles; raises `ReplicaLost` (the batch is retried).

        Any rank failure restarts all ranks: after a collective failed or timed out the group is
        unusable (NCCL aborts its communicator), and a rank that raised mid-step left its peers
        waiting in a collective."""
        self.stop()
        self.restarts += 1
        why = f"a rank of the tp={self.config.tp} replica failed ({one_line(cause)})"
        try:
            self.start()
        except Exception as exc:
            raise ReplicaLost(f"{why}; restarting its ranks failed too ({one_line(exc)})") from exc
        raise ReplicaLost(f"{why}; its ranks were restarted") from cause


GROUP_PREFIX = "dsv4batch-replica"


def group_name(job_id: str, actor_id: str) -> str:
    """The placement group of the replica that scoring actor `actor_id` of job `job_id` drives."""
    return f"{GROUP_PREFIX}-{job_id}-{actor_id}"


def release_groups() -> int:
    """Remove the replica groups of this job (call when its scoring actors are done); returns
    how many were removed."""
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    try:
        prefix = f"{GROUP_PREFIX}-{ray.get_runtime_context().get_job_id()}-"
        table = placement_group_table()
    except Exception:  # noqa: BLE001 - Ray is going down (after a failure): it removes them itself
        return 0
    removed = 0
    for group_id, entry in table.items():
        if entry.get("name", "").startswith(prefix) and entry.get("state") != "REMOVED":
            try:
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))))
                removed += 1
            except Exception:  # noqa: BLE001 - removed meanwhile
                pass
    return removed


def wait_all(refs: list, timeout_s: float) -> list:
    """ray.get of every ref, failing as soon as any one fails (not after the others time out
    in a collective its peer will never join); `TimeoutError` past `timeout_s`."""
    import ray

    deadline, pending = time.monotonic() + timeout_s, list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"{len(pending)} of {len(refs)} ranks did not answer within {timeout_s:g} s")
        ray.get(ready[0])  # raises that rank's error
    return ray.get(refs)
