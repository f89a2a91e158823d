"""Prefill chunk planners on three length mixes: fixed (pre-PR), adaptive (vLLM #45061), adaptive+sorted.

Per mix and planner: chunks (kernel launches) per micro-batch (step), total workspace elements,
peak workspace bytes, planner microseconds per step, and end-to-end tiny-model tokens/s, all
measured in one run (best of `--repeats`). `--plot PATH` draws one micro-batch's workspaces.
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.common import best_of, emit, random_prompts

MIXES = {
    "short": lambda rng, n: rng.integers(16, 160, size=n),
    "lognormal": lambda rng, n: np.clip(rng.lognormal(np.log(200), 1.0, size=n), 8, 4000).astype(int),
    # long prompts span several 2048-token steps (multi-step prefixes) among short ones
    "multistep": lambda rng, n: np.where(rng.random(n) < 0.15, rng.integers(2500, 6000, size=n),
                                         rng.integers(16, 300, size=n)),
}
VARIANTS = {"fixed": dict(planner="fixed", sort_by_length=False),
            "adaptive": dict(planner="adaptive", sort_by_length=False),
            "adaptive+sorted": dict(planner="adaptive", sort_by_length=True),
            "dp+sorted": dict(planner="dp", sort_by_length=True)}


def run_mix(model, batch, repeats):
    """Every variant: one Engine on the shared tiny `model`; stats of its last timed call."""
    from dsv4batch.model import Engine, EngineConfig

    rows, base = {}, None
    engines = {name: Engine(model, EngineConfig(max_num_batched_tokens=2048, max_model_len=8192,
                                                prefill_chunk_size=4, **kw)) for name, kw in VARIANTS.items()}
    tokens = sum(len(ids) - 1 for ids in batch)
    stats = {name: engine.score(batch)[1] for name, engine in engines.items()}  # warm-up

    def timed(name, engine):
        stats[name] = engine.score(batch)[1]

    # interleave repeats so machine noise hits every variant alike
    times = {name: float("inf") for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            times[name] = min(times[name], best_of(lambda: timed(name, engine), 1))
    for name in engines:
        st = stats[name]
        rows[name] = {
            "chunks_per_step": round(st.num_chunks / st.num_steps, 2), "steps": st.num_steps,
            "workspace_elements": st.workspace_elements, "peak_workspace_bytes": st.peak_workspace_bytes,
            "planner_us_per_step": round(1e6 * st.planner_s / st.num_steps, 1),
            "planner_share_of_forward": round(st.planner_s / times[name], 5),
            "tokens_per_s": round(tokens / times[name], 1)}
        base = base or rows[name]
        rows[name]["speedup_vs_fixed"] = round(rows[name]["tokens_per_s"] / base["tokens_per_s"], 3)
        rows[name]["peak_ws_vs_fixed"] = round(rows[name]["peak_workspace_bytes"] / base["peak_workspace_bytes"], 3)
    return {"requests": len(batch), "tokens": tokens, "variants": rows}


def plot(path: str, lengths, seed: int = 0):
    """One micro-batch (C4 layer) as workspace rectangles: width = requests, height = M rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dsv4batch.planner import fixed_prefill_chunks, length_order, plan_prefill_chunks, request_lengths

    kw = dict(compress_ratio=4, window_size=128, max_model_len=8192, max_num_batched_tokens=8192,
              prefill_chunk_size=4)
    seq = np.asarray(lengths)
    order = length_order(seq, seq, 4, 128)
    plans = {"fixed": (seq, fixed_prefill_chunks(seq, seq, **kw)),
             "adaptive": (seq, plan_prefill_chunks(seq, seq, **kw)),
             "adaptive+sorted": (seq[order], plan_prefill_chunks(seq[order], seq[order], **kw))}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (name, (s, plan)) in zip(axes, plans.items()):
        comp, gather = request_lengths(s, s, compress_ratio=4, window_size=128, max_model_len=8192,
                                       max_num_batched_tokens=8192)
        area = 0
        for c, (a, e, N, M) in enumerate(plan):
            ax.add_patch(plt.Rectangle((a, 0), e - a, M, fill=False, lw=1.5, color=f"C{c % 10}"))
            for i in range(a, e):
                ax.add_patch(plt.Rectangle((i + 0.1, 0), 0.8, comp[i], color="tab:orange", alpha=0.7))
                ax.add_patch(plt.Rectangle((i + 0.1, N), 0.8, gather[i], color="tab:blue", alpha=0.7))
            area += (e - a) * M
        ax.set_xlim(0, len(s))
        ax.set_ylim(0, max(M for *_, M in plan) * 1.05)
        ax.set_title(f"{name}: {len(plan)} chunks, {area:,} rows")
        ax.set_xlabel("request (chunk order)")
    axes[0].set_ylabel("workspace rows (orange: compressed, blue: window)")
    fig.suptitle(f"One micro-batch, C4 layer ({len(s)} requests, {int(seq.sum())} tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m dsv4batch.bench planner")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot", default=None, help="write the workspace picture (PNG) here")
    args = parser.parse_args(argv)
    from dsv4batch.model import TINY, Engine

    model = Engine.from_pretrained(TINY).model
    rng = np.random.default_rng(0)
    result = {"bench": "planner", "model": "tiny", "mixes": {}}
    for name, draw in MIXES.items():
        lengths = draw(rng, args.requests)
        batch = random_prompts(lengths, 129280, seed=1)
        result["mixes"][name] = run_mix(model, batch, args.repeats)
    if args.plot:
        lengths = MIXES["lognormal"](np.random.default_rng(3), 40)
        plot(args.plot, lengths[np.cumsum(lengths) <= 8192])
        result["plot"] = args.plot
    emit(result, args.json)
