"""Tensor and expert parallelism of one DSv4 replica: which tensor is split how, and the collectives.

The split follows DSv4's structure (as vLLM splits it):

- attention: `wq_b` and `attn_sink` by query heads, `wo_a` by output groups (a group's heads stay
  on one rank), `wo_b` row-parallel (its input columns): one all-reduce after attention. The fused
  `wq_a` / `wkv`, the norms, the compressors and the Lightning Indexer are replicated: DSv4 has one
  latent KV head, the same on every rank, so the chunk plan and the workspace are too;
- MoE: routed experts in contiguous blocks of `n_routed_experts / T` per rank (expert parallel,
  hash-routed layers included), the shared expert tensor-parallel (`w1` / `w3` by rows, `w2` by
  columns), the router replicated: one all-reduce of (routed + shared) per MoE;
- `embed` and `head` vocabulary-parallel: rank r holds ids [r V/T, (r+1) V/T); the head's exact
  log-softmax comes from each rank's (max, sum of exp, target logit) of its slice
  (`model.vocab_parallel_logprobs`), never a `[rows, vocab]` tensor;
- mHC parameters and the remaining norms replicated.

A model tensor that `split_of` names holds 1/T of the checkpoint tensor along `dim`: rank r's
slice is [r n, (r + 1) n) with n its local size (`local_range`), so the loader reads only that.
`TP` carries a rank's place and does its collectives (timed into `collective_s`). No collective
runs when `size == 1`: a one-rank model is the unsplit model, bit for bit.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch

SPLITS = (  # (model tensor name pattern, how it is split, the split dim of the model tensor)
    (re.compile(r"^layers\.\d+\.attn\.(wq_b\.|attn_sink$)"), "heads", 0),
    (re.compile(r"^layers\.\d+\.attn\.wo_a\."), "groups", 0),
    (re.compile(r"^layers\.\d+\.attn\.wo_b\."), "row_parallel", 1),
    (re.compile(r"^layers\.\d+\.ffn\.experts\."), "experts", 0),
    (re.compile(r"^layers\.\d+\.ffn\.shared_experts\.w2\."), "shared_expert", 1),
    (re.compile(r"^layers\.\d+\.ffn\.shared_experts\.w[13]\."), "shared_expert", 0),
    (re.compile(r"^(embed|head)\."), "vocab", 0),
)
# config fields a T-way split divides (a config where one does not divide is refused, by name)
SPLIT_FIELDS = ("num_attention_heads", "o_groups", "n_routed_experts", "moe_intermediate_size", "vocab_size")


def split_of(name: str) -> tuple[str, int] | None:
    """(how, dim) model tensor `name` is split across ranks, or None when it is replicated.

    Stacked routed experts (`layers.i.ffn.experts.w1`, or its `.qweight` / `.scale`) split along
    their expert dim 0; a `QuantLinear`'s `qweight` and `scale` split along the weight's dim."""
    return next(((how, dim) for pattern, how, dim in SPLITS if pattern.search(name)), None)


def split_problems(config, tp: int, quantized: bool = False) -> list[str]:
    """Why `config` cannot be split `tp` ways, each naming the config field (empty when it can).

    With FP8 weights held as stored, each rank's slice must also be whole 128-row/column blocks
    (a scale block cannot be shared by two ranks)."""
    if tp < 1:
        return [f"tp must be >= 1, got {tp}"]
    problems = [f"{k} {getattr(config, k)} is not divisible by tp {tp}" for k in SPLIT_FIELDS
                if getattr(config, k) % tp]
    if quantized and not problems and tp > 1:
        blocks = {"wq_b rows per rank (num_attention_heads / tp x head_dim)":
                  config.num_attention_heads // tp * config.head_dim,
                  "wo_a rows per rank (o_groups / tp x o_lora_rank)": config.o_groups // tp * config.o_lora_rank,
                  "wo_b columns per rank (o_groups x o_lora_rank / tp)": config.o_groups * config.o_lora_rank // tp,
                  "shared expert rows per rank (moe_intermediate_size / tp)": config.moe_intermediate_size // tp}
        problems += [f"{k} {v} is not a multiple of 128 (FP8 blocks)" for k, v in blocks.items() if v % 128]
    return problems


class SplitError(ValueError):
    """A model config that cannot be split T ways; the message names the config field."""


def check_split(config, tp: int, quantized: bool = False) -> None:
    """`SplitError` naming the config field(s) when `config` cannot be split `tp` ways."""
    problems = split_problems(config, tp, quantized)
    if problems:
        raise SplitError(f"cannot split the model {tp} ways (--tp {tp}): " + "; ".join(problems))


def rank_slice(full: torch.Tensor, dim: int, rank: int, n: int) -> torch.Tensor:
    """Rank `rank`'s block of `n` along `dim` of the whole tensor `full` (a view)."""
    return full.narrow(dim, rank * n, n)


@dataclass(eq=False)  # compared by identity: one object per rank, a shared default
class TP:
    """One rank's place in a T-way replica, and its collectives over `group` (torch.distributed).

    rank, size: this rank and T (1: no parallelism, no collective ever runs); group: the process
    group (None: the default one). `collective_s` accumulates the wall time spent in collectives
    (the engine reads it per call into `StepStats.collective_s`).
    """

    rank: int = 0
    size: int = 1
    group: object = None
    collective_s: float = 0.0

    def local_range(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's contiguous 1/T block of `total` (T divides total)."""
        n = total // self.size
        return self.rank * n, (self.rank + 1) * n

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns `t`."""
        if self.size > 1:
            import torch.distributed as dist

            t0 = time.perf_counter()
            dist.all_reduce(t, group=self.group)
            self._synchronize(t)
            self.collective_s += time.perf_counter() - t0
        return t

    @staticmethod
    def _synchronize(t: torch.Tensor) -> None:
        """NCCL returns once the collective is queued: wait for it, so `collective_s` is its time
        (the next op needs the result anyway)."""
        if t.is_cuda:
            torch.cuda.synchronize(t.device)

    def broadcast_object(self, obj):
        """Rank 0's `obj` on every rank (picklable; `obj` itself when size == 1)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        t0 = time.perf_counter()
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        self.collective_s += time.perf_counter() - t0
        return box[0]

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[size, *t.shape]: every rank's `t`, in rank order (`t` itself when size == 1)."""
        if self.size == 1:
            return t.unsqueeze(0)
        import torch.distributed as dist

        t0 = time.perf_counter()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        self._synchronize(t)
        self.collective_s += time.perf_counter() - t0
        return torch.stack(parts)


SINGLE = TP()  # the unsplit model's place
