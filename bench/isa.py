"""Each custom CPU kernel against its torch path, on the model's real shapes, on one ISA's build.

`python -m dsv4batch.bench isa [--isa native|avx512|avx2|generic] [--models tiny,dsv4-shape,unseen]
[--case single2048] [--repeats 5] [--threads N]` runs one `Engine.score` of the case per model with every kernel
on, recording each call site's arguments (attention, the indexer's top-k, the head, and the
token-wise passes at the model functions that dispatch them: `Rope.apply`, `hc_pre` (its GEMM
included), `hc_post`, `hc_collapse`, `RMSNorm`, `swiglu`), then replays the recorded calls with
the kernel and with the torch path, interleaved, best of `--repeats` (wall time, torch's thread
count). Per model and kernel: calls, ms of each path, kernel speedup, and the path the engine's
default takes on this ISA (`kernels.select`), which should be the faster one. The CPU model and
the ISA head every table (`--isa avx2` measures the AVX2 build on an AVX-512 machine).
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import torch

from bench.common import emit, machine, random_prompts

# kernel -> the `select` switch that turns it off (None: the call names its backend)
SWITCH = {"sparse_mla": None, "indexer": None, "head": "head", "rope": "elementwise", "hc_pre": "elementwise",
          "hc_post": "elementwise", "hc_collapse": "elementwise", "rms_norm": "elementwise",
          "swiglu": "elementwise"}


def clone(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def sites(engine):
    """(owner, attribute, kernel name) of every call site recorded: what the model calls."""
    import dsv4batch.model.attention as attention
    import dsv4batch.model.compressor as compressor
    import dsv4batch.model.layers as layers
    import dsv4batch.model.model as model_mod

    return [(attention, "sparse_mla_prefill", "sparse_mla"), (compressor, "indexer_topk", "indexer"),
            (engine.model, "token_logprobs", "head"), (layers.Rope, "apply", "rope"), (model_mod, "hc_pre", "hc_pre"),
            (model_mod, "hc_post", "hc_post"), (model_mod, "hc_collapse", "hc_collapse"),
            (layers.RMSNorm, "forward", "rms_norm"), (layers, "swiglu", "swiglu")]


@contextmanager
def recording(engine):
    """Within the block, every call of `sites(engine)` is recorded into the yielded dict
    (kernel -> [(function, args, kwargs)]), arguments cloned before the call (some work in place)."""
    calls, undo = {}, []
    for owner, attr, name in sites(engine):
        fn = owner.__dict__.get(attr, getattr(owner, attr))
        real = fn.__func__ if isinstance(fn, staticmethod) else fn

        def wrapper(*args, _real=real, _name=name, **kwargs):
            calls.setdefault(_name, []).append((_real, [clone(a) for a in args],
                                                {k: clone(v) for k, v in kwargs.items()}))
            return _real(*args, **kwargs)

        undo.append((owner, attr, owner.__dict__.get(attr)))
        setattr(owner, attr, staticmethod(wrapper) if isinstance(fn, staticmethod) else wrapper)
    try:
        yield calls
    finally:
        for owner, attr, old in reversed(undo):
            if old is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)


def replay(name: str, calls, on: bool) -> float:
    """Seconds to run the recorded calls of kernel `name` with the kernel (on) or its torch path."""
    from dsv4batch.kernels import select

    switch = SWITCH[name]
    args = [([clone(a) for a in a_], k) for _, a_, k in calls]  # fresh inputs: some calls work in place
    with select.force(**({switch: on} if switch else {})), torch.inference_mode():
        t0 = time.perf_counter()
        for (fn, _, _), (a, k) in zip(calls, args):
            fn(*a, **({**k, "backend": "cpu" if on else "torch"} if switch is None else k))
        return time.perf_counter() - t0


def model_rates(model_name: str, config, case: str, repeats: int) -> dict:
    """Per kernel of one model: calls, torch / kernel ms, speedup, the default path, and whether
    the default is the faster path."""
    from bench.profile import build_engine, case_lengths
    from dsv4batch.kernels import select

    engine = build_engine(model_name, config)
    batch = random_prompts(case_lengths(case), engine.model.config.vocab_size, seed=len(case))
    with select.force(**{k: True for k in select.KERNELS}), recording(engine) as calls:
        engine.score(batch)
    rows = {}
    for name in SWITCH:
        if name not in calls:
            continue
        best = {True: float("inf"), False: float("inf")}
        for _ in range(repeats):  # interleaved: the machine's noise hits both paths alike
            for on in (False, True):
                best[on] = min(best[on], replay(name, calls[name], on))
        default = select.chosen(SWITCH[name] or name)
        rows[name] = {"calls": len(calls[name]), "torch_ms": round(1e3 * best[False], 2),
                      "kernel_ms": round(1e3 * best[True], 2), "speedup": round(best[False] / best[True], 2),
                      "default": "kernel" if default else "torch",
                      "default_is_faster": default == (best[True] < best[False])}
    return rows


def table(result: dict) -> str:
    """The result as a markdown table headed by the CPU and the ISA."""
    lines = [f"CPU: {result['cpu']}; ISA: {result['isa']}; threads {result['threads']}; case {result['case']}",
             "| model | kernel | calls | torch ms | kernel ms | speedup | default |", "|---|---|---|---|---|---|---|"]
    for model, rows in result["models"].items():
        for name, r in rows.items():
            lines.append(f"| {model} | {name} | {r['calls']} | {r['torch_ms']} | {r['kernel_ms']} | "
                         f"{r['speedup']:.2f}x | {r['default']} |")
    return "\n".join(lines)


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m dsv4batch.bench isa")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--isa", default="native", help="the kernels' build: native, avx512, avx2 or generic")
    parser.add_argument("--models", default="tiny,dsv4-shape,unseen")
    parser.add_argument("--case", default="single2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from dsv4batch.model import EngineConfig

    config = EngineConfig(max_num_batched_tokens=4096, max_model_len=16384)
    result = {"bench": "isa", **machine(args.isa), "threads": torch.get_num_threads(), "case": args.case,
              "models": {}}
    for model_name in args.models.split(","):
        result["models"][model_name] = model_rates(model_name, config, args.case, args.repeats)
    emit(result, True) if args.json else print(table(result))
