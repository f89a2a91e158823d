"""Continuous batching: which requests feed which tokens in the next step (nano-vllm's scheduler).

Requests wait in arrival order (`waiting`) until the `CachePool` has a slot and the blocks for
every position they can reach (prompt + max_tokens); then they run (`running`) until they finish
and give both back, and the next waiting request takes their place at once. A step holds, within
`max_num_batched_tokens` tokens: one decode token of every running request that finished its
prefill (decodes first, as vLLM orders a batch), then prefill tokens: those of running requests
whose prompt spans steps, then of newly admitted ones. A request is admitted only while its
whole reservation fits, so nothing is ever preempted and the pool can never run out; a request
that does not fit waits (first come, first served: the ones behind it wait too).
"""

from __future__ import annotations

from collections import deque

from .cache import CachePool
from .sequence import Sequence


class Scheduler:
    """Queues of `Sequence`s over one `CachePool`; `schedule` returns the next step."""

    def __init__(self, sequences, pool: CachePool, *, max_num_batched_tokens: int, max_num_seqs: int):
        self.waiting: deque[Sequence] = deque(sequences)
        self.running: list[Sequence] = []
        self.pool, self.max_tokens, self.max_seqs = pool, max_num_batched_tokens, max_num_seqs

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], list[tuple[Sequence, int, int]]]:
        """(decodes, prefill segments [(seq, start, end)]) of the next step; admits waiting
        requests while the pool and `max_num_seqs` allow. Never empty while `has_work`."""
        budget = self.max_tokens
        decodes = [s for s in self.running if s.is_prefilled][:budget]
        budget -= len(decodes)
        segs = []
        for seq in self.running:
            if budget and not seq.is_prefilled:
                budget -= self._feed(seq, budget, segs)
        while budget and self.waiting and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            cache = self.pool.allocate(seq.num_prompt + seq.params.max_tokens)
            if cache is None:
                break
            seq.cache = cache
            self.running.append(self.waiting.popleft())
            budget -= self._feed(seq, budget, segs)
        if not decodes and not segs and self.has_work:
            raise RuntimeError("no request can run: the cache pool cannot hold the first waiting one")
        return decodes, segs

    @staticmethod
    def _feed(seq: Sequence, budget: int, segs: list) -> int:
        take = min(seq.num_prompt - seq.done, budget)
        segs.append((seq, seq.done, seq.done + take))
        return take

    def finish(self, seq: Sequence) -> None:
        """`seq` is done: its slot and blocks go back to the pool."""
        self.running.remove(seq)
        self.pool.free(seq.cache)
        seq.cache = None
