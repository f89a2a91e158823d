"""The ``"torch"`` backend of :func:`dsv4batch.kernels.sparse_mla_prefill` (an optimized path,
not the definition: that is ``ref.sparse_mla_prefill_ref``, which the tests hold this to).

Same contract as FlashMLA ``flash_mla_sparse_fwd`` (see ``dsv4batch/kernels/__init__.py``).
It is the CPU hot path of the engine, with two ways through it (same maths, fp32; fp64 when q is
fp64; no Python loop per query or head):

* **dense blocks** (only with ``query_blocks``): a block of consecutive queries that share most
  of their slots (one request's neighbouring positions: the same window, mostly the same
  compressed entries) attends over the *union* of its valid slots at once: logits
  ``[n * h_q, d_qk] x [d_qk, u]``, output ``[n * h_q, u] x [u, d_v]``, each query's own slots
  kept by a mask. Taken when ``n * u <= DENSE_FACTOR * sum of the queries' slot counts``
  (little wasted work), else the block falls through to the slices below. All blocks of a call
  are batched (``_dense_blocks``): one table counting each block's uses of its kv rows, with a
  running sum, finds every block's union (no sort), and the blocks run as bmms grouped by their
  union's padded width (a fixed grid, ``_width``), so a step of many short requests costs a few
  dozen ops per call, not per block. A block too spread out for that is *split*: the rows a
  quarter of its queries use (``COMMON_SHARE``; at long context, the window) go through the
  GEMMs, each query gathers its other slots alone, one softmax spans both.
* **gathered slices**: queries grouped by how many slots they use, each slice one gather of its
  K rows per query and two batched matmuls. Memory per slice is bounded by ``slice_elems``.

A query's arithmetic depends only on its own indices and, in a dense block, its block-mates':
callers that make blocks from one request's positions (``model/layout.py``: aligned to absolute
positions, cut at request ends) keep a request's results independent of its batch-mates.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Sequence

import torch

# Elements (K rows gathered + logits) per query slice. Small slices stay cache-resident on CPU,
# which measured faster than big ones; on CUDA bigger slices mean fewer launches.
CPU_SLICE_ELEMS = 1 << 22
CUDA_SLICE_ELEMS = 1 << 25
KC_ALIGN = 16  # slots are padded to whole 16-float vectors
# Dense blocks: the union of a block's slots may cost at most this much more work than the
# slots themselves (the two GEMMs run several times faster than per-query batched matmuls).
DENSE_FACTOR = 2
DENSE_BATCH_SLOTS = 1 << 21  # slots (and presence entries) per batch of dense-block unions (bounds memory)
# A block that is not dense shares the rows at least this fraction (1/COMMON_SHARE) of its
# queries use; each query gathers the rest alone (long context: the window is common, most of
# the compressed top-k is not).
COMMON_SHARE = 4
QUERY_BLOCK = 32  # queries per dense block (measured best of 16 / 32 / 64 on dsv4-shape: 128-256 GEMM rows)


def check_shapes(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: Optional[int]) -> None:
    """Raise ``ValueError`` unless q [s_q,h_q,d_qk], kv [s_kv,1,d_qk], indices [s_q,1,topk]."""
    if q.dim() != 3:
        raise ValueError(f"q must be [s_q, h_q, d_qk], got {tuple(q.shape)}")
    s_q, _, d_qk = q.shape
    if kv.dim() != 3 or kv.shape[1] != 1 or kv.shape[2] != d_qk:
        raise ValueError(f"kv must be [s_kv, 1, {d_qk}], got {tuple(kv.shape)}")
    if indices.dim() != 3 or indices.shape[:2] != (s_q, 1):
        raise ValueError(f"indices must be [{s_q}, 1, topk], got {tuple(indices.shape)}")
    if d_v is not None and not 0 < d_v <= d_qk:
        raise ValueError(f"d_v must be in (0, {d_qk}], got {d_v}")


@torch.no_grad()
def sparse_mla_prefill_torch(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    d_v: Optional[int] = None,
    slice_elems: Optional[int] = None,
    query_blocks: Optional[Sequence[int]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shapes/dtypes/edge cases: see ``sparse_mla_prefill`` (definition: ``ref.sparse_mla_prefill_ref``).
    ``slice_elems`` bounds one slice.

    query_blocks: increasing query boundaries ``[0, b_1, ..., s_q]`` (ints): the candidate dense
    blocks ``[b_i, b_i+1)`` (see the module docstring); None: gathered slices only."""
    check_shapes(q, kv, indices, d_v)
    s_q, h_q, d_qk = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    d_v = d_qk if d_v is None else int(d_v)
    dev = q.device
    inf = float("inf")
    # one spare row past s_q: where dense blocks write their padding queries
    outs = (torch.empty(s_q + 1, h_q, d_v, dtype=q.dtype, device=dev),  # lonely rows zeroed below
            torch.full((s_q + 1, h_q), -inf, dtype=torch.float32, device=dev),
            torch.full((s_q + 1, h_q), inf, dtype=torch.float32, device=dev))
    out, max_logits, lse = (t[:s_q] for t in outs)
    if s_q == 0 or topk == 0 or s_kv == 0:
        return out.zero_(), max_logits, lse
    kvz, gidx, invalid, kcq = _slots(q, kv, indices, topk_length)
    sink = None if attn_sink is None else attn_sink.to(dev, kvz.dtype).reshape(1, h_q)
    if slice_elems is None:
        slice_elems = CUDA_SLICE_ELEMS if dev.type == "cuda" else CPU_SLICE_ELEMS
    if query_blocks is not None:
        _all_dense_blocks(q, kvz, gidx, invalid, kcq, query_blocks, sm_scale, sink, d_v, outs, slice_elems)
    order, pieces = _slices(kcq, slice_elems, d_qk, h_q)
    if pieces is None:  # lonely queries (no valid slot): out 0
        out[order.to(dev)] = 0
        return out, max_logits, lse
    _run_slices(q, kvz, gidx, invalid, order, pieces, sm_scale, sink, d_v, (out, max_logits, lse))
    return out, max_logits, lse


def _slots(q, kv, indices, topk_length):
    """(kvz, gidx, invalid, kcq): kv in the compute dtype plus one zero row (index s_kv: every
    invalid slot gathers that row, so whatever an invalid index names - NaN rows, garbage, out of
    range - never enters the math); gidx [s_q, W] the kv row of each slot (s_kv when invalid) and
    invalid [s_q, W], the slot axis padded to W, a multiple of KC_ALIGN, with invalid slots (whole
    vector blocks); kcq [s_q] (CPU) each query's last valid slot rounded up to KC_ALIGN."""
    s_q, _, d_qk = q.shape
    s_kv, topk, dev = kv.shape[0], indices.shape[-1], q.device
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    kvz = torch.cat([kv.reshape(s_kv, d_qk).to(cdt), kv.new_zeros(1, d_qk, dtype=cdt)])
    idx = indices.reshape(s_q, topk).to(dev)
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        valid &= torch.arange(topk, device=dev) < topk_length.to(dev).reshape(s_q, 1)
    gidx = torch.where(valid, idx.long(), s_kv)
    invalid = ~valid
    width = -(-topk // KC_ALIGN) * KC_ALIGN
    if width != topk:
        gidx = torch.cat([gidx, gidx.new_full((s_q, width - topk), s_kv)], 1)
        invalid = torch.cat([invalid, invalid.new_ones(s_q, width - topk)], 1)
        topk = width
    # Each query computes over kc = its own last valid slot rounded up to KC_ALIGN, and queries
    # run grouped by kc (a stable sort): a query's arithmetic (GEMM widths, reduction lengths)
    # is fixed by its own indices, whatever else the call holds (batch invariance), and a short
    # query no longer pays for the widest query of its slice.
    ncols = ((~invalid) * torch.arange(1, topk + 1, device=dev, dtype=torch.int32)).amax(1).cpu()
    kcq = (ncols + KC_ALIGN - 1) // KC_ALIGN * KC_ALIGN
    return kvz, gidx, invalid, kcq


def _all_dense_blocks(q, kvz, gidx, invalid, kcq, query_blocks, sm_scale: float, sink, d_v: int, outs,
                      slice_elems: int) -> None:
    """Run the dense blocks of `query_blocks` (checked here), a batch of blocks at a time;
    their queries' kcq become -1 (left out of the slices)."""
    s_q, topk, s_kv = q.shape[0], gidx.shape[1], kvz.shape[0] - 1
    bounds = [int(b) for b in query_blocks]
    if bounds[0] != 0 or bounds[-1] != s_q or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"query_blocks must rise strictly from 0 to s_q={s_q}")
    # blocks whose unions are found at once (bounds the slot and presence tensors)
    per = max(1, DENSE_BATCH_SLOTS // max(QUERY_BLOCK * topk, s_kv + 1))
    done = torch.zeros(s_q, dtype=torch.bool)
    for i in range(0, len(bounds) - 1, per):
        done |= _dense_blocks(q, kvz, gidx, invalid, kcq, bounds[i:i + per + 1], sm_scale, sink, d_v,
                              outs, slice_elems)
    kcq[done] = -1  # done: left out of the slices below


def _slices(kcq: torch.Tensor, slice_elems: int, d_qk: int, h_q: int):
    """(order, pieces): the queries sorted by kcq (stable; the dense blocks' -1 dropped) and the
    slices (first, end, kc) of that order, each bounded by `slice_elems`; lonely queries (kc 0)
    are in no piece. pieces None when there are none: order is then the lonely queries."""
    order = torch.argsort(kcq, stable=True)
    widths, counts = torch.unique_consecutive(kcq[order], return_counts=True)
    if counts.numel() and int(widths[0]) == -1:  # the dense blocks' queries
        order, widths, counts = order[int(counts[0]):], widths[1:], counts[1:]
    pieces, a = [], 0  # lonely queries (kc 0) keep 0 / -inf / +inf
    for kc, count in zip(widths.tolist(), counts.tolist()):
        step = max(1, int(slice_elems) // (kc * (d_qk + h_q))) if kc else count
        pieces += [(i, min(i + step, a + count), kc) for i in range(a, a + count, step) if kc]
        a += count
    lonely = int(counts[0]) if counts.numel() and int(widths[0]) == 0 else 0
    return (order[:lonely], None) if not pieces else (order, (pieces, lonely))


def _run_slices(q, kvz, gidx, invalid, order, plan, sm_scale: float, sink, d_v: int, outs) -> None:
    """The gathered slices: per piece one gather of its queries' K rows and two batched matmuls,
    into `outs` = (out, max_logits, lse); the lonely queries (the first `lonely` of order) get out 0."""
    pieces, lonely = plan
    out, max_logits, lse = outs
    dev, (_, h_q, d_qk), cdt, inf = q.device, q.shape, kvz.dtype, float("inf")
    if lonely:
        out[order[:lonely].to(dev)] = 0
    # Reused buffers: fresh big allocations per slice cost page faults on CPU.
    kbuf = torch.empty(max((b - a) * kc for a, b, kc in pieces) * d_qk, dtype=cdt, device=dev)
    pbuf = torch.empty(kbuf.numel() // d_qk * h_q, dtype=cdt, device=dev)
    obuf = torch.empty(max(b - a for a, b, _ in pieces) * h_q * d_v, dtype=cdt, device=dev)
    first, order_dev = order.tolist(), order.to(dev)
    for a, b, kc in pieces:
        n = b - a
        # the piece's queries: a plain slice when they are consecutive (a long request), else an index
        sel = slice(first[a], first[a] + n) if first[b - 1] - first[a] == n - 1 else order_dev[a:b]
        k = torch.index_select(kvz, 0, gidx[sel, :kc].reshape(-1), out=kbuf[: n * kc * d_qk].view(n * kc, d_qk))
        k = k.view(n, kc, d_qk)                                                # [n, kc, d_qk]
        p = pbuf[: n * h_q * kc].view(n, h_q, kc)
        torch.bmm(q[sel].to(cdt), k.transpose(1, 2), out=p).mul_(sm_scale)    # [n, h_q, kc]
        p.masked_fill_(invalid[sel, None, :kc], -inf)
        o_buf = obuf[: n * h_q * d_v].view(n, h_q, d_v)
        o, m, lse_s = _softmax_values(p, sink, lambda w: torch.bmm(w, k[..., :d_v], out=o_buf))
        out[sel] = o.to(out.dtype)
        max_logits[sel] = m
        lse[sel] = lse_s


def _softmax_values(p: torch.Tensor, sink, values):
    """p [n, h_q, w] scaled logits, -inf where invalid (overwritten) -> (out [n, h_q, d_v] =
    softmax-with-sink(p) @ V, max_logits [n, h_q], lse [n, h_q]); `values(weights)` does the
    @ V on the normalised weights (p, overwritten). Lonely rows: out 0, max -inf, lse +inf."""
    inf = float("inf")
    m = p.amax(-1)                                                             # [n, h_q]
    m_safe = torch.where(m == -inf, 0.0, m)                                    # lonely rows: 0
    p.sub_(m_safe.unsqueeze(-1)).exp_()
    denom = p.sum(-1)
    lse_s = torch.where(denom > 0, m_safe + denom.log(), inf)                  # lonely -> +inf
    lse_o = lse_s
    if sink is not None:                                                       # sink -inf: exact no-op
        # logaddexp as max + log1p(exp(-|d|)): torch.logaddexp rounds a tensor's last
        # (len % vector width) elements on a scalar path, tying a query's bits to its slice.
        gap = (lse_s - sink).abs().nan_to_num_(nan=inf)                        # inf - inf: 0 weight
        lse_o = torch.where(sink == -inf, lse_s, torch.maximum(lse_s, sink) + torch.log1p(torch.exp(-gap)))
    # normalise the weights, not the output: [n, h_q, w] is smaller than [n, h_q, d_v] when w < d_v
    return values(p.mul_(torch.exp(m_safe - lse_o).unsqueeze(-1))), m, lse_s


def _width(u: torch.Tensor) -> torch.Tensor:
    """Padded union widths [n] for union sizes u [n]: multiples of 16 up to 64, then four steps
    per octave (at most 25% padding). Fixed, so a block's GEMM shapes depend on itself alone."""
    grid = torch.tensor(WIDTH_GRID, dtype=u.dtype, device=u.device)
    at = torch.searchsorted(grid, u).clamp_(max=len(WIDTH_GRID) - 1)
    return torch.where(u <= grid[-1], grid[at], (u + KC_ALIGN - 1) // KC_ALIGN * KC_ALIGN)


WIDTH_GRID = [16, 32, 48, 64] + [2 ** e * k // 4 for e in range(6, 20) for k in (5, 6, 7, 8)]


def _dense_blocks(q, kvz, gidx, invalid, kcq, bounds, sm_scale: float, sink, d_v: int, outs,
                  slice_elems: int) -> torch.Tensor:
    """Every block [b_i, b_i+1) of `bounds` over the shared part of its slots, batched.

    gidx [s_q, W] kv rows (invalid slots: s_kv, the zero row), kcq [s_q] CPU slot counts
    (KC_ALIGN-rounded). A block's *common* rows: all its valid rows when the block is dense
    (union not empty and n * u <= DENSE_FACTOR * its queries' kcq summed), else the rows that at
    least a COMMON_SHARE-th of its queries (and >= 2) use; a query's other slots are *private*.
    A block is taken when it is dense, or its common rows are not empty and n * u_c <=
    DENSE_FACTOR * (its slots on common rows). Taken blocks run in groups of one (padded common
    width `_width`, private width): per group one gather of the common rows [G, U, d_qk] and one
    of each query's private rows [G * n, P, d_qk], logits [G, n * h_q, U] (one bmm, a mask keeping
    each query to its own slots) beside [G * n, h_q, P], one softmax over both, the output as
    one bmm over the common rows plus one over the private ones.
    Results go into `outs` = (out, max_logits, lse), each with one spare row at s_q that the
    padding queries write; returns done [s_q] bool (CPU): the queries written."""
    s_q = q.shape[0]
    b = _block_rows(gidx, kcq, bounds, s_q, kvz.shape[0] - 1)
    done = torch.zeros(s_q, dtype=torch.bool)
    if not bool(b.take.any()):
        return done
    g = _block_groups(b, bounds, s_q, kvz.shape[0] - 1)
    h_q, d_qk, n = q.shape[1], q.shape[2], b.n
    for s0, s1, group in g.segments:
        w, pw = g.pairs[group]
        per_block = w * (n * h_q + d_qk) + n * pw * (h_q + d_qk)                # logits + K rows
        step = max(1, slice_elems // per_block)
        for g0 in range(s0, s1, step):
            _run_blocks(q, kvz, g, n, g0, min(g0 + step, s1), w, pw, sm_scale, sink, d_v, outs)
    done[b.qidx[g.pick][b.qidx[g.pick] < s_q]] = True
    return done


def _block_rows(gidx, kcq, bounds, s_q: int, s_kv: int) -> SimpleNamespace:
    """Each block's kv rows as a count over its span (no sort), which of them are common, and
    which blocks are taken (`_dense_blocks`): size [nb], n, qidx [nb, n] (its queries, padded
    with s_q), keys [nb, n * W], free (slots naming no row), lo [nb, 1], rel (keys - lo; free:
    span), span, common [nb, span + 1], rank (common column + 1), on_common, take [nb] (CPU)."""
    dev = gidx.device
    size = torch.tensor(bounds).diff()
    nb, n = len(size), int(size.max())
    # qidx [nb, n]: each block's queries, padded with s_q (a row of zero queries / zero-row slots)
    qidx = torch.tensor(bounds[:-1])[:, None] + torch.arange(n)
    qidx = torch.where(torch.arange(n) < size[:, None], qidx, s_q)
    slots = torch.cat([kcq, kcq.new_zeros(1)]).clamp(min=0)[qidx].sum(1)
    keys = torch.cat([gidx, gidx.new_full((1, gidx.shape[1]), s_kv)])[qidx.to(dev)].view(nb, -1)
    # Each block's rows as a count over its span of kv rows (no sort): uses[b, r] = how many of
    # its slots name row lo_b + r; a running sum over the common rows gives each one's column
    # (ascending kv rows). Invalid slots name the zero row s_kv (above every valid row, so the
    # row minimum skips them) and go to a spare last column.
    free = keys == s_kv
    lo = keys.amin(1, keepdim=True)                                             # [nb, 1]
    rel = keys - lo
    span = int(rel.masked_fill(free, -1).amax()) + 1
    rel.masked_fill_(free, span)
    uses = torch.zeros(nb, span + 1, dtype=torch.int32, device=dev).scatter_add_(
        1, rel, torch.ones_like(rel, dtype=torch.int32))
    uses[:, span] = 0
    u = (uses > 0).sum(1).cpu()
    is_dense = (u > 0) & (size * u <= DENSE_FACTOR * slots)
    least = torch.where(is_dense, 1, (size // COMMON_SHARE).clamp(min=2))       # uses of a common row
    common = uses >= least.to(dev)[:, None]
    rank = common.to(torch.int32).cumsum(1, dtype=torch.int32)                  # column + 1
    u_c = rank[:, span].contiguous().cpu()
    on_common = common.gather(1, rel)                                           # [nb, n * W]
    take = is_dense | ((u_c > 0) & (size * u_c <= DENSE_FACTOR * on_common.sum(1).cpu()))
    return SimpleNamespace(size=size, n=n, qidx=qidx, keys=keys, free=free, lo=lo, rel=rel, span=span,
                           common=common, rank=rank, u_c=u_c, on_common=on_common, take=take)


def _block_groups(b: SimpleNamespace, bounds, s_q: int, s_kv: int) -> SimpleNamespace:
    """The taken blocks of `_block_rows`' `b`, ordered by (padded common width, private width),
    each pair one run (in-place runs first, `_runs_first`), with the tensors `_run_blocks` reads:
    pick, first_q, is_full, pairs, segments, rows (common kv rows), drop (not the query's slot),
    p_rows / p_count (each query's private rows), qi (its queries), q_rows (clamped to real rows)."""
    dev, nb, n = b.keys.device, len(b.size), b.n
    col = (b.rank.gather(1, b.rel).long() - 1).masked_fill_(~b.on_common, -1).view(nb, n, -1)
    private = (~b.on_common & ~b.free).view(nb, n, -1)                          # [nb, n, W]
    num_private = private.sum(2)                                                # [nb, n]
    p_width = ((num_private.amax(1) + KC_ALIGN - 1) // KC_ALIGN * KC_ALIGN).cpu()
    width = _width(b.u_c.long())
    pick = torch.nonzero(b.take).flatten()
    pair = width[pick] * (1 << 24) + p_width[pick]
    order = torch.argsort(pair, stable=True)
    pick, (pairs, counts) = pick[order], torch.unique_consecutive(pair[order], return_counts=True)
    pairs = torch.stack([pairs >> 24, pairs & ((1 << 24) - 1)], 1)
    # a run of consecutive full blocks (one long request) reads q and writes out in place
    first_q, is_full = torch.tensor(bounds[:-1])[pick], b.size[pick] == n
    perm, segments = _runs_first(first_q.tolist(), is_full.tolist(), counts.tolist(), n)
    pick, first_q, is_full = pick[perm], first_q[perm], is_full[perm]
    m_all, pd = len(pick), pick.to(dev)
    w_max, pw_max = int(pairs[:, 0].max()), int(pairs[:, 1].max())
    rows = torch.full((m_all, w_max + 1), s_kv, dtype=torch.long, device=dev)  # each block's common kv rows
    blk, r = torch.nonzero(b.common[pd, :b.span]).unbind(1)
    rows[blk, b.rank[pd][blk, r].long() - 1] = r + b.lo[pd][blk, 0]
    c = col[pd]
    drop = torch.ones(m_all, n, w_max + 1, dtype=torch.bool, device=dev)       # True: not the query's slot
    drop.scatter_(2, torch.where(c < 0, w_max, c), False)
    p_rows = p_count = None
    if pw_max:  # each query's private kv rows in slot order, padded with the zero row (masked later)
        priv = private[pd]
        at = torch.where(priv, priv.cumsum(2) - 1, pw_max)
        p_rows = torch.full((m_all, n, pw_max + 1), s_kv, dtype=torch.long, device=dev).scatter_(
            2, at, b.keys.view(nb, n, -1)[pd])
        p_count = num_private[pd]
    qi = b.qidx[pick].to(dev)                                                   # [m_all, n]
    return SimpleNamespace(pick=pick, first_q=first_q, is_full=is_full, pairs=pairs.tolist(), segments=segments,
                           rows=rows, drop=drop, p_rows=p_rows, p_count=p_count, qi=qi,
                           q_rows=qi.clamp(max=s_q - 1))  # padding queries compute on a real row


def _run_blocks(q, kvz, g: SimpleNamespace, n: int, g0: int, g1: int, w: int, pw: int, sm_scale: float, sink,
                d_v: int, outs) -> None:
    """Blocks g0..g1 of `_block_groups`' `g` (one group: common width w, private width pw) into
    `outs`: logits over the common and private rows, one softmax, the values."""
    dev, (_, h_q, d_qk) = q.device, q.shape
    out, max_logits, lse = outs
    m = g1 - g0
    q0 = int(g.first_q[g0])
    is_run = bool(g.is_full[g0:g1].all()) and int(g.first_q[g1 - 1]) - q0 == (m - 1) * n
    k = kvz.index_select(0, g.rows[g0:g1, :w].reshape(-1)).view(m, w, d_qk)
    if is_run:
        qs = q[q0:q0 + m * n].reshape(m, n * h_q, d_qk).to(k.dtype)
    else:
        qs = q.index_select(0, g.q_rows[g0:g1].flatten()).view(m, n * h_q, d_qk).to(k.dtype)
    p = torch.bmm(qs, k.transpose(1, 2)).view(m * n, h_q, w)
    mask = g.drop[g0:g1, :, :w].reshape(m * n, 1, w)
    if pw:
        kp = kvz.index_select(0, g.p_rows[g0:g1, :, :pw].reshape(-1)).view(m * n, pw, d_qk)
        pp = torch.bmm(qs.view(m * n, h_q, d_qk), kp.transpose(1, 2))           # [m * n, h_q, pw]
        pad = torch.arange(pw, device=dev) >= g.p_count[g0:g1].reshape(m * n, 1, 1)
        p, mask = torch.cat([p, pp], 2), torch.cat([mask, pad], 2)
    p = p.mul_(sm_scale).masked_fill_(mask, float("-inf"))
    o_view = out[q0:q0 + m * n].view(m, n * h_q, d_v) if is_run and out.dtype == k.dtype else None

    def values(x):
        o = torch.bmm(x[..., :w].reshape(m, n * h_q, w), k[..., :d_v], out=o_view)
        o = o.view(m * n, h_q, d_v)
        return o.baddbmm_(x[..., w:], kp[..., :d_v]) if pw else o

    o, mx, ls = _softmax_values(p, sink, values)
    if is_run:
        if o_view is None:
            out[q0:q0 + m * n] = o.to(out.dtype)
        max_logits[q0:q0 + m * n], lse[q0:q0 + m * n] = mx, ls
    else:
        dst = g.qi[g0:g1].flatten()
        out.index_copy_(0, dst, o.to(out.dtype))
        max_logits.index_copy_(0, dst, mx)
        lse.index_copy_(0, dst, ls)


# Consecutive full blocks (queries) from which a group's blocks run in place (q read as a slice,
# out written as one) instead of through the gathered copies of q and out (measured: a 2,047-token
# request's window layer spent 17 of 68 ms in them when one short last block joined its group).
RUN_MIN = 4


def _runs_first(first_q: list, is_full: list, counts: list, n: int):
    """Order each group's blocks (`counts[g]` consecutive picks of one GEMM shape) as its runs of
    >= RUN_MIN consecutive full blocks (first query `first_q`, `n` queries each), then its other
    blocks. Returns (perm: pick positions, segments: (start, end, g) of perm to run together)."""
    perm, segments, a = [], [], 0
    for g, count in enumerate(counts):
        rest, j, end = [], a, a + count
        while j < end:
            e = j + 1
            while is_full[j] and e < end and is_full[e] and first_q[e] - first_q[e - 1] == n:
                e += 1
            if e - j >= RUN_MIN:
                segments.append((len(perm), len(perm) + e - j, g))
                perm += range(j, e)
            else:
                rest += range(j, e)
            j = e
        if rest:
            segments.append((len(perm), len(perm) + len(rest), g))
            perm += rest
        a = end
    return perm, segments
