"""Capacity plan: how many GPUs one DSv4 replica needs, from config.json and safetensors headers.

Pure arithmetic (`plan_capacity`) over the bytes of every model tensor as `load_model` would hold
it (`model_tensor_bytes`: the loader's own `meta` model, FP8/FP4 weights as stored, the rest in the
compute dtype; no tensor data is read). Per rank of a T-way replica:

- weights: the replicated part plus 1/T of the split part, split as the shards issue does: `wq_b`
  and `attn_sink` by query heads, `wo_a` by output groups, `wo_b` row-parallel, routed experts by
  blocks of experts, the shared expert tensor-parallel, `embed` / `head` by vocabulary; the rest
  (`wq_a`, `wkv`, norms, compressors, indexer, router, mHC) is replicated on every rank;
- workspace: the planner's warm-up reservation `prefill_chunk_size * (ceil(L/r) + W + mnbt)` rows
  of `head_dim` per layer type (`planner.chunk_budget`); one pool serves every layer, so a rank
  reserves the largest (the KV head is not split: every rank holds the same rows);
- activations of one step of `max_batched_tokens` tokens: `step_activations` (the engine's largest
  live tensors, term by term; replicated parts such as the indexer scores are not split).

A rank fits when the three sum to at most `gpu_memory_utilization` (default 0.9, vLLM's) of
its memory; `smallest_tp` is the first T of `TP_CHOICES` that divides the split dimensions and fits.
"""

from __future__ import annotations

import math

from ..planner import chunk_budget
from .config import EngineConfig
from .head import VOCAB_TILE
from .parallel import split_of, split_problems

TP_CHOICES = (1, 2, 4, 8)
GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
def weight_bytes(tensor_bytes: dict[str, int]) -> dict:
    """{"replicated": bytes, "split": {how: bytes}, "split_total": bytes, "total": bytes}, split as
    `parallel.split_of` says."""
    split: dict[str, int] = {}
    replicated = 0
    for name, size in tensor_bytes.items():
        how = split_of(name)
        if how is None:
            replicated += size
        else:
            split[how[0]] = split.get(how[0], 0) + size
    return {"replicated": replicated, "split": split, "split_total": sum(split.values()),
            "total": replicated + sum(split.values())}


def workspace(config, ratios, *, max_model_len: int, max_batched_tokens: int, prefill_chunk_size: int,
              dtype_bytes: int) -> dict:
    """The planner's reservation per layer ratio (bytes) and the pool's size (their maximum)."""
    by_ratio = {int(r): chunk_budget(r, config.sliding_window, max_model_len, max_batched_tokens,
                                     prefill_chunk_size) * config.head_dim * dtype_bytes for r in ratios}
    return {"by_ratio": by_ratio, "reserved": max(by_ratio.values())}


def step_activations(config, ratios, *, tp: int, max_model_len: int, max_batched_tokens: int,
                     dtype_bytes: int, logits_slice: int = EngineConfig.logits_slice, query_slice: int = 1024) -> dict:
    """Bytes of one step's largest live tensors on one rank, term by term (fp32 where the engine is):

    - residual: the mHC streams `[T, hc, H]` (old, new, and `hc_post`'s product) plus `hc_pre`'s
      two fp32 `[T, hc * H]` temporaries;
    - attention: q, its RoPE copy, the output and its inverse-RoPE copy `[T, heads / tp, head_dim]`;
    - indexer (CSA layers): one query slice's fp32 scores `[min(T, 1024), index_n_heads, ceil(L/4)]`
      (all of a request's entries are scored) plus the fp32 queries `[T, index_n_heads, index_head_dim]`;
    - moe: the routed copies of the tokens and their outputs `[T * top_k, H]` and the combined sum;
    - head: two fp32 logits tiles `[logits_slice, VOCAB_TILE]` (the fused head's only vocabulary-
      sized buffers: the tile being reduced while the next one's GEMM writes) plus the slice's
      zero-padded input `[logits_slice, H]`;
    - carried: what a request longer than a step keeps between steps in every layer (window,
      compressed entries, indexer keys for `max_model_len` tokens).

    total = residual + carried + the largest of attention, indexer, moe and head (they do not
    overlap: each is freed before the next starts).
    """
    t, h, hc, d, b = max_batched_tokens, config.hidden_size, config.hc_mult, config.head_dim, dtype_bytes
    phases = {
        "attention": 4 * t * (config.num_attention_heads // tp) * d * b,
        "indexer": (min(t, query_slice) * config.index_n_heads * math.ceil(max_model_len / 4)
                    + t * config.index_n_heads * config.index_head_dim) * 4 if 4 in ratios else 0,
        "moe": 3 * t * config.num_experts_per_tok * h * b,
        "head": logits_slice * (2 * min(VOCAB_TILE, math.ceil(config.vocab_size / tp)) + h) * 4,
    }
    carried = 0
    for r in config_ratios(config):
        carried += (config.sliding_window - 1) * d * b
        if r > 1:
            carried += max_model_len // r * d * b
        if r == 4:
            carried += max_model_len // 4 * config.index_head_dim * b
    terms = {"residual": t * hc * h * (3 * b + 2 * 4), "carried": carried, **phases}
    return {**terms, "total": terms["residual"] + carried + max(phases.values())}


def cache_budget(model_config, spec, *, max_num_seqs: int, max_model_len: int, max_batched_tokens: int,
                 device, prefill_chunk_size: int = 4) -> int:
    """The generation cache pool's default byte budget (`EngineConfig.max_cache_mib` None).

    spec: the model's `cache.CacheSpec`. What `max_num_seqs` requests of `max_model_len`
    positions hold, at most: on the CPU a quarter of the host's memory; on a GPU what it has free
    now (weights loaded) less the planner's workspace and one step's activations, times 0.9
    (vLLM's gpu_memory_utilization). Never below one such request (the pool then refuses it by
    name if the memory is truly not there)."""
    want = max_num_seqs * spec.request_bytes(max_model_len)
    one = spec.request_bytes(max_model_len)
    if getattr(device, "type", device) == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        ratios = sorted(set(spec.ratios))
        kw = dict(max_model_len=max_model_len, max_batched_tokens=max_batched_tokens, dtype_bytes=spec.dtype_bytes)
        step = (workspace(model_config, ratios, prefill_chunk_size=prefill_chunk_size, **kw)["reserved"]
                + step_activations(model_config, ratios, tp=1, **kw)["total"])
        room = int(0.9 * free) - step
    else:
        import os

        room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    return max(one, min(want, room))


def config_ratios(config) -> list[int]:
    """Each layer's compress ratio (1 = sliding window only), from `layer_types`."""
    from .config import layer_ratio

    return [layer_ratio(config, i) for i in range(config.num_hidden_layers)]


def plan_capacity(config, tensor_bytes: dict[str, int], *, gpu_memory_bytes: int, max_model_len: int,
                  max_batched_tokens: int, dtype: str = "bfloat16", tp: int | None = None,
                  prefill_chunk_size: int = 4, logits_slice: int = EngineConfig.logits_slice,
                  gpu_memory_utilization: float = 0.9) -> dict:
    """The capacity plan of one replica (all sizes in bytes).

    config: a `DeepseekV4Config`; tensor_bytes: model tensor name -> resident bytes (as
    `model_tensor_bytes` gives); tp: evaluate only this T (default: every T in `TP_CHOICES`).
    Returns {"weights": `weight_bytes`, "workspace": `workspace`, "ranks": [one dict per T with
    weight/workspace/activation/total bytes, "fits" and "problems"], "smallest_tp": the first T that
    fits or None, "reason": why none fits (None when one does), ...the inputs}.
    """
    b = DTYPE_BYTES[dtype]
    ratios = sorted(set(config_ratios(config)))
    usable = int(gpu_memory_bytes * gpu_memory_utilization)
    weights = weight_bytes(tensor_bytes)
    quantized = any(name.endswith(".qweight") for name in tensor_bytes)
    ws = workspace(config, ratios, max_model_len=max_model_len, max_batched_tokens=max_batched_tokens,
                   prefill_chunk_size=prefill_chunk_size, dtype_bytes=b)
    ranks = []
    for t in ([tp] if tp else TP_CHOICES):
        act = step_activations(config, ratios, tp=t, max_model_len=max_model_len,
                               max_batched_tokens=max_batched_tokens, dtype_bytes=b, logits_slice=logits_slice)
        per_rank = weights["replicated"] + math.ceil(weights["split_total"] / t)
        total = per_rank + ws["reserved"] + act["total"]
        problems = split_problems(config, t, quantized)
        if total > usable:
            problems.append(f"a rank needs {total / GIB:.1f} GiB (weights {per_rank / GIB:.1f}, workspace "
                            f"{ws['reserved'] / GIB:.2f}, activations {act['total'] / GIB:.2f}) > {usable / GIB:.1f} "
                            f"GiB usable ({gpu_memory_utilization:g} x {gpu_memory_bytes / GIB:.1f} GiB)")
        ranks.append({"tp": t, "weight_bytes": per_rank, "workspace_bytes": ws["reserved"], "activations": act,
                      "activation_bytes": act["total"], "total_bytes": total, "fits": not problems,
                      "problems": problems})
    smallest = next((r["tp"] for r in ranks if r["fits"]), None)
    reason = None if smallest else "; ".join(f"tp {r['tp']}: {', '.join(r['problems'])}" for r in ranks)
    return {"dtype": dtype, "gpu_memory_bytes": gpu_memory_bytes, "usable_bytes": usable,
            "gpu_memory_utilization": gpu_memory_utilization, "max_model_len": max_model_len,
            "max_batched_tokens": max_batched_tokens, "prefill_chunk_size": prefill_chunk_size,
            "layer_ratios": ratios, "weights": weights, "workspace": ws, "ranks": ranks,
            "smallest_tp": smallest, "reason": reason}


def model_tensor_bytes(path_or_name: str, dtype: str = "bfloat16", weights: str = "stored"):
    """(config, {model tensor name: resident bytes}, {"checkpoint_bytes", "ignored_bytes"}) of a
    checkpoint folder or `TINY`, from config.json and the safetensors headers (a `meta` model; the
    checkpoint is checked like `check_checkpoint`, no tensor data is read)."""
    import torch

    from .loader import IGNORED, check_tensors, prepared_model
    from .model import model_tensors

    model, shards = prepared_model(path_or_name, getattr(torch, dtype), weights)
    sizes = {name: t.numel() * t.element_size() for name, t in model_tensors(model).items()}
    stored = {"checkpoint_bytes": 0, "ignored_bytes": 0}
    if shards is not None:
        check_tensors(model, shards)
        for shard in shards:
            for name in shard.keys():
                stored["checkpoint_bytes"] += shard.nbytes(name)
                stored["ignored_bytes"] += shard.nbytes(name) if IGNORED.match(name) else 0
    return model.config, sizes, stored


def replica_fits(model_path: str, tp: int, gpu_memory_bytes: int, max_model_len: int, max_batched_tokens: int,
                 *, dtype: str = "bfloat16", weights: str = "stored", prefill_chunk_size: int = 4) -> tuple[bool, str]:
    """(whether one `tp`-rank replica of `model_path` fits GPUs of `gpu_memory_bytes` each, why).

    The reason names the numbers; when it does not fit it also names the smallest T that would.
    Raises the loader's `ModelLoadError` for a folder that would not load."""
    config, sizes, _ = model_tensor_bytes(model_path, dtype, weights)
    kw = dict(gpu_memory_bytes=gpu_memory_bytes, max_model_len=max_model_len, max_batched_tokens=max_batched_tokens,
              dtype=dtype, prefill_chunk_size=prefill_chunk_size)
    rank = plan_capacity(config, sizes, tp=tp, **kw)["ranks"][0]
    if rank["fits"]:
        return True, (f"tp {tp}: a rank needs {rank['total_bytes'] / GIB:.1f} GiB of "
                      f"{gpu_memory_bytes / GIB:.1f} GiB")
    smallest = plan_capacity(config, sizes, **kw)["smallest_tp"]
    hint = f"; the smallest tp that fits is {smallest}" if smallest else f"; no tp in {TP_CHOICES} fits"
    return False, f"tp {tp}: " + "; ".join(rank["problems"]) + hint
