"""The request cache pool: what every running request's next token needs, preallocated per replica.

Per layer, a DSv4 request carries (vLLM keeps the same per layer type):

- every layer: its last W raw kv rows (the sliding window) -> a *ring* of W rows;
- compressed layers (ratio r = 4 CSA, 128 HCA): its compressed entries -> *entry rows*; and the
  compressor's open window: the pending (kv, gate) rows of the window not closed yet, after (r = 4:
  overlapping windows) the last closed window's rows -> `coff * r` *state rows* of
  `coff * head_dim` (coff = 2 for r = 4, else 1);
- ratio-4 layers: the Lightning Indexer's keys (one per entry, `index_head_dim` wide) and its own
  ratio-4 compressor's open window, the same way.

Storage, one tensor per layer and kind, allocated once (`CachePool`), written in place:

    kv[l]        [num_slots * W + num_blocks * B // r_l, head_dim]   ring rows, then entry rows
    idx[l]       [num_blocks * B // 4, index_head_dim]               ratio-4 layers
    comp[l]      (kv [num_slots, coff * r, coff * head_dim], gate fp32, same shape)   r > 1
    idx_comp[l]  the same at index_head_dim                           ratio-4 layers

A *slot* (ring + open windows) belongs to one running request; a *block* holds the entries of
`block_tokens` = B consecutive positions (B a multiple of every ratio) in every compressed layer,
so a request's entry k of ratio r sits in block `blocks[k // (B / r)]` (nano-vllm's block table,
one table serving every layer). Ring and entry rows share one tensor so that one sparse-attention
call reads a query's window and its entries in place. A request takes a slot and the blocks for
every position it can reach (`CachePool.allocate`: prompt + max new tokens) when it is admitted,
so it never needs more later and nothing is preempted; both return to the free lists when it
finishes. The budget is in bytes (`CacheSpec.sizes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .config import layer_ratio
from .layout import ranges


@dataclass(frozen=True)
class CacheSpec:
    """The cache geometry of a model (from its `DeepseekV4Config`) in one dtype.

    ratios: each layer's compress ratio (1: sliding window only); window W; head_dim; idx_dim
    (index_head_dim); dtype_bytes: bytes of one element of the compute dtype (gates are fp32);
    block_tokens B: positions per block, the least common multiple of the compressed ratios.
    """

    ratios: tuple[int, ...]
    window: int
    head_dim: int
    idx_dim: int
    dtype_bytes: int

    @classmethod
    def of(cls, config, dtype_bytes: int) -> "CacheSpec":
        ratios = tuple(layer_ratio(config, i) for i in range(config.num_hidden_layers))
        return cls(ratios, config.sliding_window, config.head_dim, config.index_head_dim, dtype_bytes)

    @property
    def block_tokens(self) -> int:
        return math.lcm(*[r for r in self.ratios if r > 1] or [1])

    def state_shape(self, r: int, dim: int) -> tuple[int, int]:
        """(rows, width) of one slot's open-window state of a ratio-r compressor of width `dim`."""
        coff = 2 if r == 4 else 1
        return coff * r, coff * dim

    def slot_bytes(self) -> int:
        """Bytes of one slot: every layer's ring and open windows."""
        b = self.dtype_bytes
        total = 0
        for r in self.ratios:
            total += self.window * self.head_dim * b
            dims = [self.head_dim] + ([self.idx_dim] if r == 4 else []) if r > 1 else []
            for dim in dims:
                rows, width = self.state_shape(r, dim)
                total += rows * width * (b + 4)  # kv in the compute dtype, gate fp32
        return total

    def block_bytes(self) -> int:
        """Bytes of one block: every compressed layer's entries (and indexer keys) of B positions."""
        total = 0
        for r in self.ratios:
            if r > 1:
                total += self.block_tokens // r * (self.head_dim + (self.idx_dim if r == 4 else 0))
        return total * self.dtype_bytes

    def blocks_for(self, num_positions: int) -> int:
        """Blocks a request reaching `num_positions` positions holds (0 without compressed layers)."""
        return -(-num_positions // self.block_tokens) if self.block_bytes() else 0

    def request_bytes(self, num_positions: int) -> int:
        """Bytes one request of `num_positions` positions holds: a slot and its blocks."""
        return self.slot_bytes() + self.blocks_for(num_positions) * self.block_bytes()

    def sizes(self, budget_bytes: int, max_num_seqs: int, max_model_len: int) -> tuple[int, int]:
        """(num_slots, num_blocks) of a pool of at most `budget_bytes`: as many slots as
        `max_num_seqs` allows while one request of `max_model_len` still fits beside them, the
        rest in blocks. ValueError when not even one such request fits."""
        one = self.request_bytes(max_model_len)
        if budget_bytes < one:
            raise ValueError(f"the cache budget {budget_bytes / 2**20:.2f} MiB cannot hold one request of "
                             f"max_model_len={max_model_len} tokens ({one / 2**20:.2f} MiB); raise max_cache_mib "
                             "or lower max_model_len")
        full_blocks = self.blocks_for(max_model_len) * self.block_bytes()
        slots = max(1, min(max_num_seqs, (budget_bytes - full_blocks) // self.slot_bytes()))
        blocks = (budget_bytes - slots * self.slot_bytes()) // self.block_bytes() if self.block_bytes() else 0
        return int(slots), int(blocks)


@dataclass
class SeqCache:
    """One request's place in a `CachePool`: its slot and block table (int64 numpy)."""

    slot: int
    blocks: np.ndarray


class CachePool:
    """The preallocated tensors of `CacheSpec` for `num_slots` requests and `num_blocks` blocks,
    with free lists; `peak_bytes` is the largest share held by requests at once."""

    def __init__(self, spec: CacheSpec, num_slots: int, num_blocks: int, dtype: torch.dtype, device):
        self.spec, self.num_slots, self.num_blocks = spec, num_slots, num_blocks
        self.kv, self.idx, self.comp, self.idx_comp = {}, {}, {}, {}
        W, B = spec.window, spec.block_tokens
        for layer, r in enumerate(spec.ratios):
            rows = num_slots * W + (num_blocks * B // r if r > 1 else 0)
            self.kv[layer] = torch.empty(rows, spec.head_dim, dtype=dtype, device=device)
            if r > 1:
                self.comp[layer] = self._state(r, spec.head_dim, dtype, device)
            if r == 4:
                self.idx[layer] = torch.empty(num_blocks * B // 4, spec.idx_dim, dtype=dtype, device=device)
                self.idx_comp[layer] = self._state(r, spec.idx_dim, dtype, device)
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.peak_bytes = 0

    def _state(self, r: int, dim: int, dtype, device):
        rows, width = self.spec.state_shape(r, dim)
        return (torch.empty(self.num_slots, rows, width, dtype=dtype, device=device),
                torch.empty(self.num_slots, rows, width, dtype=torch.float32, device=device))

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.spec.slot_bytes() + self.num_blocks * self.spec.block_bytes()

    @property
    def used_bytes(self) -> int:
        slots = self.num_slots - len(self.free_slots)
        blocks = self.num_blocks - len(self.free_blocks)
        return slots * self.spec.slot_bytes() + blocks * self.spec.block_bytes()

    def can_allocate(self, num_positions: int) -> bool:
        return bool(self.free_slots) and len(self.free_blocks) >= self.spec.blocks_for(num_positions)

    def allocate(self, num_positions: int) -> SeqCache | None:
        """A slot and the blocks of `num_positions` positions, or None when the pool lacks them."""
        if not self.can_allocate(num_positions):
            return None
        n = self.spec.blocks_for(num_positions)
        blocks = np.array([self.free_blocks.pop() for _ in range(n)], np.int64)
        cache = SeqCache(self.free_slots.pop(), blocks)
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return cache

    def free(self, cache: SeqCache | None) -> None:
        if cache is not None:
            self.free_slots.append(cache.slot)
            self.free_blocks.extend(int(b) for b in cache.blocks[::-1])

    # -- row arithmetic (numpy, int64), shared by every layer of a ratio

    def ring_rows(self, slots, positions) -> np.ndarray:
        """kv rows of positions (one per element) in their requests' rings."""
        W = self.spec.window
        return np.asarray(slots, np.int64) * W + np.asarray(positions, np.int64) % W

    def entry_rows(self, caches: list[SeqCache], firsts, counts, r: int) -> np.ndarray:
        """Entry rows (of `idx[l]`; `kv[l]` rows are these + `entry_base`) of entries
        [first_i, first_i + count_i) of each request, concatenated in order."""
        per_block = self.spec.block_tokens // r
        firsts, counts = np.asarray(firsts, np.int64), np.asarray(counts, np.int64)
        if not len(caches) or counts.sum() == 0:
            return np.zeros(0, np.int64)
        offsets = np.cumsum(counts) - counts
        k = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(offsets - firsts, counts)
        table_lens = np.array([len(c.blocks) for c in caches], np.int64)
        tables = np.concatenate([c.blocks for c in caches])
        table_off = np.repeat(np.cumsum(table_lens) - table_lens, counts)
        return tables[table_off + k // per_block] * per_block + k % per_block

    @property
    def entry_base(self) -> int:
        """Where entry rows start in every `kv[l]` (after the rings)."""
        return self.num_slots * self.spec.window

    def state_rows(self, slots, starts, counts, r: int) -> np.ndarray:
        """Rows of the flattened open-window state [num_slots * rows, width] of rows
        [start_i, start_i + count_i) of each request's slot, concatenated."""
        rows = self.spec.state_shape(r, 1)[0]  # rows per slot (the same at every width)
        return ranges(np.asarray(slots, np.int64) * rows + np.asarray(starts, np.int64), counts)
