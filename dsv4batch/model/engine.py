"""The scoring engine: validates requests, cuts them into packed steps, runs the model, gathers logprobs.

`Engine` owns everything around the `DSv4Model` computation (nano-vllm's split): the
`EngineConfig`, the tokenizer, the chunk workspace pool and the step loop. One `score` call
returns its outputs and a `StepStats`; nothing is kept on the side between calls.
"""

from __future__ import annotations

import time
import warnings
from typing import Sequence

import numpy as np
import torch

from ..kernels import KernelConfig, attention_backend, bf16_available, current_kernels, use_kernels
from .attention import WorkspacePool
from .cache import CachePool, CacheSpec
from .config import EngineConfig
from .head import TokenScores
from .heap import retain_freed_memory
from .loader import load_model
from .model import DSv4Model
from .parallel import SINGLE
from .stats import StepStats
from .step import RequestState, StepContext, step_plans
from .tokenizer import TokenizerMissing, load_tokenizer, tokenizer_source


# attention kernels that read a query's kv rows where they are (the torch path copies all of kv)
IN_PLACE_KERNELS = ("cpu", "flashmla", "triton")


def carried_lives(steps) -> dict:
    """Requests whose positions span several of `steps` ([(state, start, end)] per step):
    {("start", i): [states first fed in step i], ("end", i): [states last fed in step i]}."""
    first, last = {}, {}
    for i, segs in enumerate(steps):
        for st, _, _ in segs:
            first.setdefault(id(st), (i, st))
            last[id(st)] = i
    lives: dict = {}
    for key, (i, st) in first.items():
        if last[key] > i:
            lives.setdefault(("start", i), []).append(st)
            lives.setdefault(("end", last[key]), []).append(st)
    return lives


def validate(batch: Sequence[Sequence[int]], vocab: int, max_len: int) -> list[np.ndarray]:
    """Requests as int64 arrays; `ValueError` naming the first empty, out-of-vocab (ids outside
    [0, vocab)) or too long (more than `max_len` ids) one."""
    arrays = []
    for i, ids in enumerate(batch):
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size == 0:
            raise ValueError(f"request {i} is empty: give at least one token id (e.g. bos)")
        if arr.min() < 0 or arr.max() >= vocab:
            bad = int(arr[(arr < 0) | (arr >= vocab)][0])
            raise ValueError(f"request {i} has token id {bad} outside the vocabulary [0, {vocab})")
        if arr.size > max_len:
            raise ValueError(f"request {i} has {arr.size} tokens, more than max_model_len={max_len}")
        arrays.append(arr)
    return arrays


def kernel_config(config: EngineConfig, base: KernelConfig | None = None) -> KernelConfig:
    """The kernels an engine under `config` runs: `config.attn_backend` for attention (and the
    indexer), the other families as `base` has them (default: the active `KernelConfig`, all
    "auto" unless bench or a test chose otherwise with `kernels.use_kernels`)."""
    return (base or current_kernels()).replace(attention=config.attn_backend)


class Engine:
    """Scores token-id requests with `model` (per-token log p) under `config`.

    tokenizer: a `tokenizers.Tokenizer` (the checkpoint's or the packaged DSv4 one) or None; the
    engine itself only takes ids. pool: the `WorkspacePool` every chunk workspace comes from.
    kernels: the `KernelConfig` its steps run under (`kernel_config(config)`, resolved once here,
    and again when `config` is replaced; made the active one around every step, so no kernel call
    reads anything else).
    """

    def __init__(self, model: DSv4Model, config: EngineConfig | None = None, tokenizer=None):
        self._base_kernels = current_kernels()  # the non-attention families, as chosen when made
        self.model, self.config, self.tokenizer = model, config or EngineConfig(), tokenizer
        self.pool = WorkspacePool()
        self._generation_pool: CachePool | None = None
        if model is not None and self.device.type == "cpu":  # (the step tests schedule without a model)
            retain_freed_memory()
            if self.config.head_precision == "bf16" and self.head_precision == "fp32":
                warnings.warn("head_precision='bf16': this CPU has no bf16 GEMM units (AVX512-BF16 or AMX) "
                              "or KernelConfig.gemm is 'blas'; the head computes in fp32", RuntimeWarning,
                              stacklevel=2)

    @classmethod
    def from_pretrained(cls, path_or_name: str, *, device="cpu", dtype=torch.float32,
                        config: EngineConfig | None = None, weights: str = "stored", tp=SINGLE,
                        tokenizer: str | None = None) -> "Engine":
        """Load a checkpoint folder (config.json, *.safetensors, tokenizer.json) or `TINY`.

        weights: "stored" keeps FP8/FP4 checkpoint weights quantized, "compute" dequantizes them
        into `dtype` at load (see `loader.load_model`). tp: this rank's `parallel.TP` in a split
        replica (its process group initialised; every rank then calls `score` alike).
        tokenizer: a tokenizer.json file, a folder holding one, or "dsv4" (the packaged DSv4
        tokenizer); None: the folder's own tokenizer.json, and a folder without one gives an
        engine without a tokenizer (`tokenizer` None: ids only), never another tokenizer."""
        model = load_model(path_or_name, device=device, dtype=dtype, weights=weights, tp=tp)
        try:
            tok = load_tokenizer(tokenizer_source(path_or_name, tokenizer))
        except TokenizerMissing:
            if tokenizer is not None:
                raise
            tok = None
        return cls(model, config, tok)

    @property
    def config(self) -> EngineConfig:
        return self._config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        self._config, self.kernels = config, kernel_config(config, self._base_kernels)

    @property
    def device(self):
        return self.model.device

    @property
    def head_precision(self) -> str:
        """What the vocabulary head's GEMM computes in: the head weight's dtype when it is not
        fp32 ("bf16" / "fp16": a bf16 model's head whatever is asked), else "bf16" where
        `config.head_precision` asks for it and it runs (the CPU backend with bf16 units,
        `kernels.bf16_available`), else "fp32"."""
        dtype = self.model.head.weight.dtype
        if dtype != torch.float32:
            return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype).removeprefix("torch."))
        with use_kernels(self.kernels):
            is_bf16 = self.config.head_precision == "bf16" and self.device.type == "cpu" and bf16_available()
        return "bf16" if is_bf16 else "fp32"

    @property
    def attn_kernel(self) -> str:
        """The sparse attention kernel this engine's steps run: "cpu", "torch", "flashmla" or "triton"
        (`kernels.attention`, i.e. `config.attn_backend`, resolved for the model's device, dtype and
        head dim); "<name> (unavailable)" for a forced one that cannot run here (every step then
        raises, and the pipeline's fault handling answers those rows with the error)."""
        asked = self.kernels.attention
        try:
            return attention_backend(asked, self.device, self.model.head.weight.dtype, self.model.config.head_dim)
        except RuntimeError:  # forced and unusable: reported, not raised (an actor must still start)
            return f"{asked} (unavailable)"

    def validate(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Requests as int64 arrays; `ValueError` naming the first empty, out-of-vocab or too long one."""
        return validate(batch, self.model.config.vocab_size, self.config.max_model_len)

    def schedule(self, states: list[RequestState]):
        """Yield steps [(state, start, end)] of at most max_num_batched_tokens query tokens.

        A request feeds positions [0, len - 1): the last token is only a target. Long requests
        span steps and continue first in the next one. Advances each `state.done`.
        """
        budget, step = self.config.max_num_batched_tokens, []
        pending = [s for s in states if len(s.ids) > 1]
        used = 0
        while pending:
            st = pending[0]
            take = min(len(st.ids) - 1 - st.done, budget - used)
            step.append((st, st.done, st.done + take))
            st.done += take
            used += take
            if st.done == len(st.ids) - 1:
                pending.pop(0)
            if used == budget or not pending:
                yield step
                step, used = [], 0

    def score(self, batch: Sequence[Sequence[int]]) -> tuple[list[np.ndarray], StepStats]:
        """For each request of ids, float32 [len(ids) - 1]: element t-1 = log p(ids[t] | ids[:t]).

        Also returns what this call did (`StepStats`, model_calls=1). `ValueError` for a bad request.
        Where a request's logits are not finite (a checkpoint whose values overflow) its logprobs
        there are NaN or -inf, never a made-up number: `head.first_nonfinite(logprobs)` finds the
        first such position, and `score_details` names it (`TokenScores.error`).
        """
        model, rows, precision = self.model, self.config.logits_slice, self.config.head_precision
        outs, stats = self._run(batch, lambda h, t: (model.token_logprobs(h, t, rows, precision),))
        return [o[0] for o in outs], stats

    def score_details(self, batch: Sequence[Sequence[int]], top_k: int = 0
                      ) -> tuple[list[TokenScores], StepStats]:
        """`score` plus, per position, whether the target is the argmax and the top-K tokens
        (`head.TokenScores`); the logprobs are bit-identical to `score`'s. A request whose
        logits are not finite has `TokenScores.error` set ("non-finite logits at position N", N
        indexing its logprobs); the other requests of the call are unaffected."""
        if not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k must be a non-negative int, got {top_k!r}")
        model, rows, precision = self.model, self.config.logits_slice, self.config.head_precision
        outs, stats = self._run(batch, lambda h, t: model.head_details(h, t, rows, top_k, precision))
        return [TokenScores(lp, greedy.astype(bool), ids.astype(np.int32), top)
                for lp, greedy, ids, top in outs], stats

    def _nothing(self, head) -> list[np.ndarray]:
        """`head`'s outputs for zero positions (their dtypes and trailing shapes)."""
        hidden = torch.zeros(0, self.model.config.hidden_size, device=self.device)
        return [p.cpu().numpy() for p in head(hidden, torch.zeros(0, dtype=torch.long,
                                                                  device=self.device))]

    @torch.inference_mode()
    def _run(self, batch, head) -> tuple[list[tuple], StepStats]:
        """The step loop; `head(hidden [n, hidden], targets [n])` -> tensors with n rows first,
        returned per request as numpy arrays of its positions."""
        with use_kernels(self.kernels):
            return self._steps(batch, head)

    def _steps(self, batch, head) -> tuple[list[tuple], StepStats]:
        """`_run`'s loop, under the engine's kernels."""
        arrays = self.validate(batch)
        stats = StepStats(model_calls=1)
        t0 = time.perf_counter()
        order = np.argsort([len(a) for a in arrays], kind="stable") if self.config.sort_by_length \
            else np.arange(len(arrays))
        states = [RequestState(arrays[i]) for i in order]
        outputs = {id(st): [] for st in states}
        self.pool.peak_bytes = 0
        model, device, tp = self.model, self.device, self.model.tp
        collective_s = tp.collective_s
        steps = list(self.schedule(states))
        lives = carried_lives(steps)
        cache = self.carry_pool(lives)
        is_in_place = self.attn_kernel in IN_PLACE_KERNELS
        window = model.config.sliding_window
        # the chunk plan is the same on every rank (one latent KV head): rank 0 plans, one
        # broadcast per call shares it
        plans = [step_plans(segs, model.ratios, window, self.config, stats) for segs in steps] \
            if tp.rank == 0 else None
        plans = tp.broadcast_object(plans)
        if len(plans) != len(steps):  # ranks cut the batch differently: never run unmatched collectives
            raise RuntimeError(f"rank {tp.rank} has {len(steps)} steps, rank 0 planned {len(plans)}")
        for i, (segs, plan) in enumerate(zip(steps, plans)):
            for st in lives.get(("start", i), ()):
                st.cache = cache.allocate(len(st.ids))
            ctx = StepContext(segs, ratios=model.ratios, window=window, config=self.config, ropes=model.ropes,
                              pool=self.pool, stats=stats, device=device, plans=plan, cache=cache,
                              is_in_place=is_in_place)
            hidden = model.hidden_step(ctx, self.kernels.attention)
            targets = torch.from_numpy(np.concatenate([st.ids[s + 1:e + 1] for st, s, e in segs])).to(device)
            parts = [p.cpu().numpy() for p in head(hidden, targets)]
            for b, (st, s, e) in enumerate(segs):  # a request's steps come in position order
                outputs[id(st)].append([p[ctx.cu[b]:ctx.cu[b + 1]] for p in parts])
            for st in lives.get(("end", i), ()):
                cache.free(st.cache)
                st.cache = None
        result = [None] * len(arrays)
        for st, i in zip(states, order):
            pieces = outputs[id(st)] or [self._nothing(head)]  # a lone bos: no position
            result[i] = tuple(np.concatenate(cols) for cols in zip(*pieces))
        stats.forward_s = time.perf_counter() - t0
        stats.collective_s = tp.collective_s - collective_s
        stats.peak_workspace_bytes = self.pool.peak_bytes
        return result, stats

    @property
    def cache_spec(self) -> CacheSpec:
        return CacheSpec.of(self.model.config, self.model.head.weight.element_size())

    def carry_pool(self, lives: dict) -> CachePool | None:
        """A `CachePool` just large enough for the requests `carried_lives` found spanning
        steps (the most alive at once), or None when no request spans two steps."""
        spec, alive, blocks, peak = self.cache_spec, 0, 0, (0, 0)
        for i in range(1 + max((k[1] for k in lives), default=-1)):
            for st in lives.get(("start", i), ()):
                alive, blocks = alive + 1, blocks + spec.blocks_for(len(st.ids))
            peak = (max(peak[0], alive), max(peak[1], blocks))
            for st in lives.get(("end", i), ()):
                alive, blocks = alive - 1, blocks - spec.blocks_for(len(st.ids))
        if peak[0] == 0:
            return None
        return CachePool(spec, peak[0], peak[1], self.model.head.weight.dtype, self.device)

    def generate(self, prompts: Sequence[Sequence[int]], params=None, on_step=None) -> tuple[list, StepStats]:
        """Generate a continuation of each prompt of token ids: (`generate.Generation` per prompt,
        in order; `StepStats`). params: one `SamplingParams` for all, or one per prompt (None:
        the defaults: greedy, 256 tokens). Continuous batching over the engine's cache pool
        (`generate.py`; `on_step(stats, running, waiting)` after each step). `ValueError` naming
        the first bad request. A request whose logits are not finite at a step stops there with
        `Generation.error` ("non-finite logits at position N", N its generated tokens so far)
        and finish_reason "error"; the others go on."""
        from .generate import run_generation, validate_generation
        from .sampling import SamplingParams

        arrays = self.validate(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(arrays)
        validate_generation(arrays, list(params), self.model.config.vocab_size, self.config.max_model_len)
        if not arrays:
            return [], StepStats(model_calls=1)
        with use_kernels(self.kernels):
            return run_generation(self, arrays, list(params), on_step)

    def generation_pool(self) -> CachePool:
        """The cache pool of `generate` (allocated once, at the first call): `config.max_cache_mib`
        or `capacity.cache_budget`, cut into slots and blocks by `CacheSpec.sizes`."""
        if self._generation_pool is None:
            from .capacity import cache_budget

            spec, c = self.cache_spec, self.config
            budget = int(c.max_cache_mib * 2**20) if c.max_cache_mib is not None else cache_budget(
                self.model.config, spec, max_num_seqs=c.max_num_seqs, max_model_len=c.max_model_len,
                max_batched_tokens=c.max_num_batched_tokens, device=self.device,
                prefill_chunk_size=c.prefill_chunk_size)
            # every rank holds the same pool (one latent KV head): rank 0's sizes, so that every
            # rank admits the same requests
            slots, blocks = self.model.tp.broadcast_object(spec.sizes(budget, c.max_num_seqs, c.max_model_len))
            self._generation_pool = CachePool(spec, slots, blocks, self.model.head.weight.dtype, self.device)
        return self._generation_pool

    def forward_step(self, segs, decodes, cache: CachePool | None, stats: StepStats) -> torch.Tensor:
        """One packed step of decode tokens and prefill segments -> final hidden [T, hidden]
        (decode rows first); plans its chunks (the same on every rank: numpy, deterministic)."""
        model = self.model
        ctx = StepContext(segs, decodes=decodes, ratios=model.ratios, window=model.config.sliding_window,
                          config=self.config, ropes=model.ropes, pool=self.pool, stats=stats, device=self.device,
                          cache=cache, is_in_place=self.attn_kernel in IN_PLACE_KERNELS)
        with use_kernels(self.kernels):
            return model.hidden_step(ctx, self.kernels.attention)

    def score_tokens(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """`score(batch)`'s outputs alone."""
        return self.score(batch)[0]
