"""What the speed work must not change: the fused head, the batched indexer, the tensor sizes.

- the fused head (`tiled_logprobs`) equals a full log-softmax and a row's logprob does not depend
  on its slice-mates or its place in the slice (batch invariance, exactly);
- the chunk-batched Lightning Indexer picks what scoring each request alone picks;
- mHC's Sinkhorn gives the same bits on its numpy (CPU) and torch paths and for a token alone;
- a request scored among 24 short ones equals it scored alone (1e-6) on the tiny model;
- no op of a step produces a `[T, T]`-sized tensor or one with a vocabulary-sized dimension.
No timings are asserted here: the speed itself is measured by `python -m dsv4batch.bench profile`.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4batch.model import TINY, Engine, EngineConfig
from dsv4batch.kernels.indexer import canonical_topk, tie_free_keys
from dsv4batch.model.layout import RatioLayout
from dsv4batch.model.head import tiled_logprobs
from dsv4batch.model.layers import sinkhorn_


@pytest.fixture(scope="module")
def tiny():
    return Engine.from_pretrained(TINY)


def test_fused_head_equals_log_softmax_and_ignores_batch_mates():
    gen = torch.Generator().manual_seed(0)
    vocab, hidden, rows = 5000, 48, 32  # 5000 = 2 full tiles of 2048 + a partial one
    weight = torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5
    x = 3 * torch.randn(rows, hidden, generator=gen)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[:3] = torch.tensor([0, 2047, vocab - 1])  # tile edges
    got = tiled_logprobs(x, weight, targets)
    ref = -F.cross_entropy(x.double() @ weight.double().t(), targets, reduction="none")
    np.testing.assert_allclose(got.numpy(), ref.numpy(), atol=2e-5, rtol=0)
    # the same row among other rows, at another place: bit-identical
    other = torch.randn(rows, hidden, generator=gen)
    other_targets = torch.randint(0, vocab, (rows,), generator=gen)
    for src, dst in ((0, 17), (5, rows - 1), (rows - 1, 0)):
        mixed, mixed_targets = other.clone(), other_targets.clone()
        mixed[dst], mixed_targets[dst] = x[src], targets[src]
        assert tiled_logprobs(mixed, weight, mixed_targets)[dst] == got[src]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_batched_indexer_matches_per_request_scoring(tiny, backend):
    attn = next(layer.attn for layer in tiny.model.layers if layer.attn.indexer is not None)
    indexer, gen = attn.indexer, torch.Generator().manual_seed(1)
    starts, ends = np.array([0, 0, 100, 0]), np.array([90, 7, 260, 33])  # request 2 continues
    cu = np.concatenate([[0], np.cumsum(ends - starts)])
    comp = ends // 4
    N = int(comp.max())
    M = N + int(((ends - starts) + np.minimum(starts, 127)).max())
    lay = RatioLayout(starts, ends, cu, 4, 128, [(0, 4, N, M)], "cpu")
    chunk, T = lay.chunks[0], int(cu[-1])
    iq = torch.randn(T, indexer.num_heads, indexer.dim, generator=gen)
    iw = torch.randn(T, indexer.num_heads, generator=gen)
    table = torch.randn(lay.entries_end, indexer.dim, generator=gen)
    width = min(indexer.topk, N)
    keys = table[chunk.key_index]
    for block_elems in (1 << 20, 100):  # one block for the chunk / blocks of 16 queries
        blocks = chunk.query_slices(block_elems)
        seen = (chunk.key_lo + chunk.comp_len).numpy()
        # a block scores up to the last key one of its queries sees, not its requests' ends
        assert [k_hi for _, _, _, k_hi in blocks] == [int(seen[a:b].max()) for a, b, _, _ in blocks]
        picks = indexer.select(iq, iw, keys, chunk.key_lo, chunk.comp_len, blocks, width, backend)
        for b in range(4):
            own = table[torch.from_numpy(lay.entry_rows(b))]
            for t in range(int(cu[b]), int(cu[b + 1])):
                visible = int(chunk.comp_len[t])
                s = (iw[t, :, None] * indexer.dim ** -0.5 * (iq[t] @ own[:visible].t()).relu()).sum(0)
                k = min(width, visible)
                got = picks[t, :k]
                assert len(set(got.tolist())) == k and all(0 <= e < visible for e in got.tolist())
                # the k best scores, best first (equal scores may come in either order)
                np.testing.assert_allclose(s[got].numpy(), s.topk(k).values.numpy(), rtol=1e-5, atol=1e-6)


def test_topk_keys_order_like_floats_and_break_ties_by_column():
    scores = torch.tensor([[0.0, -0.0, 1.5, -2.0, float("-inf"), 1.5, -1e-30, 3e38]])
    keys = tie_free_keys(scores)
    order = keys.argsort(descending=True, stable=True)[0].tolist()
    assert order == [7, 2, 5, 0, 1, 6, 3, 4]  # ties (0.0 / -0.0, 1.5 / 1.5): lower column first
    wide = torch.cat([scores, torch.full((1, 100), float("-inf"))], 1)
    assert tie_free_keys(wide).topk(4).indices.tolist() == [[7, 2, 5, 0]]
    # canonical_topk: plain topk where the best k + 1 are distinct, the tie-free order where not
    rows = torch.cat([wide, torch.arange(108.0).flip(0)[None]])
    assert canonical_topk(rows, 4).tolist() == [[7, 2, 5, 0], [0, 1, 2, 3]]
    zeros = torch.zeros(3, 50)  # all tied: lowest columns, in order, whatever the width
    assert canonical_topk(zeros, 3).tolist() == [[0, 1, 2]] * 3


def test_sinkhorn_paths_agree_bitwise_and_ignore_batch_mates():
    gen = torch.Generator().manual_seed(3)
    comb = torch.rand(4, 4, 37, generator=gen) * 3  # [i, j, T], an odd T (vector tails)
    by_numpy = sinkhorn_(comb.clone(), 20, 1e-6, is_numpy=True)
    by_torch = sinkhorn_(comb.clone(), 20, 1e-6, is_numpy=False)
    assert torch.equal(by_numpy, by_torch)
    alone = sinkhorn_(comb[:, :, 29:30].contiguous(), 20, 1e-6)
    assert torch.equal(alone[:, :, 0], by_numpy[:, :, 29])
    # doubly stochastic: columns (over i) sum to 1 after the last step, rows nearly so
    torch.testing.assert_close(by_numpy.sum(0), torch.ones(4, 37), atol=1e-5, rtol=0)
    torch.testing.assert_close(by_numpy.sum(1), torch.ones(4, 37), atol=1e-3, rtol=0)


def test_request_among_short_requests_equals_alone(tiny):
    # 24 short requests share the indexer's query blocks, head slices and every elementwise op;
    # alone, a request is its own step. (Bit-identical on this machine's CPU; before the mHC sums,
    # sigmoid/silu/softplus and logaddexp were made position-independent, up to 5.7e-6 apart.)
    rng = np.random.default_rng(3)
    batch = [[0] + rng.integers(3, 129280, size=int(n)).tolist() for n in rng.integers(8, 200, size=24)]
    together = tiny.score_tokens(batch)
    for i in (0, 7, 23):
        np.testing.assert_allclose(together[i], tiny.score_tokens([batch[i]])[0], atol=1e-6, rtol=0)


class LargestOutputs(TorchDispatchMode):
    """Records the largest element count and the largest dimension of every op's outputs."""

    def __init__(self):
        super().__init__()
        self.numel, self.dim = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:  # 1-d: flat reusable buffers
                self.numel, self.dim = max(self.numel, t.numel()), max(self.dim, max(t.shape))
        return out


def test_no_quadratic_or_vocabulary_sized_tensor(tiny):
    T = 2400  # one step: [T, T] would be 5.8M elements, more than any buffer the step needs
    engine = Engine(tiny.model, EngineConfig(max_num_batched_tokens=4096))
    ids = [0] + np.random.default_rng(4).integers(3, 129280, size=T).tolist()
    with LargestOutputs() as seen:
        engine.score([ids])
    assert seen.numel < T * T, seen.numel
    assert seen.dim < tiny.model.config.vocab_size, seen.dim
