"""Whole-pipeline tokens/s on a local Ray vs a bare in-process loop over the same model and rows.

The bare loop is the limit on this machine: tokenize + `score_tokens` per batch in one process,
nothing else. The pipeline is `dsv4batch.pipeline.run` (read -> tokenize actors -> scoring actor
-> Parquet sink, metrics actor) with the same model, rows, torch threads and batch size. Its
rate is reported twice: over the whole run (`wall`: Ray Data startup, actor start and model
load included) and while the scoring actors ran (`active`: first batch start to last batch end,
the steady state a long job sees). Then a sweep over Ray Data `batch_size` and batches in flight
per actor. Everything is measured in one run; the bare loop is timed before and after the
pipeline runs and its best is used (the machine is shared). Both use `--torch-threads`.

    python -m dsv4batch.bench pipeline --json [--rows 64] [--batch-sizes 8,32,64] [--in-flight 1,2,4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from bench.common import emit


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def sample_rows(n: int):
    import pyarrow.parquet as pq

    path = os.path.join(os.path.dirname(__file__), "..", "dsv4batch", "data", "sample.parquet")
    table = pq.read_table(path, columns=["id", "prompt"])
    return table.slice(0, min(n, table.num_rows))


def bare_loop(engine, cfg, table, batch_size: int) -> dict:
    """Tokenize + score in-process, batch by batch, as the actor would see them."""
    from dsv4batch.jobspec import schema as S
    from dsv4batch.pipeline.stages.tokenize import Tokenize

    tok = Tokenize(cfg)
    t0 = time.perf_counter()
    tokens = 0
    for start in range(0, table.num_rows, batch_size):
        batch = tok(table.slice(start, batch_size))
        reqs = [r for r in batch[S.INPUT_IDS].to_pylist() if len(r) > 1]
        engine.score(reqs)
        tokens += sum(len(r) for r in reqs)
    dt = time.perf_counter() - t0
    return {"batch_size": batch_size, "input_tokens": tokens, "seconds": round(dt, 3),
            "tokens_per_s": round(tokens / dt, 1)}


def pipeline_run(cfg, src: str, batch_size: int, in_flight: int) -> dict:
    from dsv4batch.pipeline.runner import run

    out = tempfile.mkdtemp(prefix="dsv4batch-bench-out-")
    try:
        m = run(cfg.replace(input=src, output=out, overwrite=True, batch_size=batch_size,
                            batches_in_flight=in_flight), log=lambda _msg: None)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"batch_size": batch_size, "batches_in_flight": in_flight, "rows": m["rows"],
            "input_tokens": m["input_tokens"], "wall_s": m["wall_s"], "active_s": m["active_s"],
            "tokens_per_s_wall": m["tokens_per_s"], "tokens_per_s_active": m["active_tokens_per_s"],
            "forward_s": m["time_s"]["forward"], "tokenize_s": m["time_s"]["tokenize"],
            "model_load_s": m["time_s"]["model_load_max"]}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rows", type=int, default=64, help="rows of the bundled sample")
    parser.add_argument("--batch-sizes", type=ints, default=[8, 32, 64])
    parser.add_argument("--in-flight", type=ints, default=[1, 2, 4])
    parser.add_argument("--default-batch-size", type=int, default=32)
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch threads in the bare loop and in the actor (1 is fastest on "
                             "a shared 2-core machine)")
    args = parser.parse_args(argv)

    import pyarrow.parquet as pq
    import ray
    import torch

    from dsv4batch.jobspec.config import ScoreConfig
    from dsv4batch.model import Engine, EngineConfig

    threads = args.torch_threads
    torch.set_num_threads(threads)
    cfg = ScoreConfig(model=args.model, torch_threads=threads, progress=False)
    table = sample_rows(args.rows)
    tmp = tempfile.mkdtemp(prefix="dsv4batch-bench-")
    src = os.path.join(tmp, "in.parquet")
    pq.write_table(table, src)
    engine = Engine.from_pretrained(args.model, config=EngineConfig(**cfg.engine_kwargs()))
    sizes = sorted(set(args.batch_sizes) | {args.default_batch_size})
    bare_before = {b: bare_loop(engine, cfg, table, b) for b in sizes}

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    try:
        runs = [pipeline_run(cfg, src, b, f) for b in args.batch_sizes for f in args.in_flight]
        default = pipeline_run(cfg, src, args.default_batch_size, cfg.batches_in_flight)
    finally:
        ray.shutdown()
    bare_after = {b: bare_loop(engine, cfg, table, b) for b in sizes}
    bare = {b: max(bare_before[b]["tokens_per_s"], bare_after[b]["tokens_per_s"]) for b in sizes}
    for r in [*runs, default]:
        r["ratio_active"] = round(r["tokens_per_s_active"] / bare[r["batch_size"]], 3)
        r["ratio_wall"] = round(r["tokens_per_s_wall"] / bare[r["batch_size"]], 3)
    shutil.rmtree(tmp, ignore_errors=True)
    emit({
        "model": args.model, "rows": table.num_rows, "input_tokens": default["input_tokens"],
        "cpus": os.cpu_count(), "torch_threads": threads, "replicas": 1,
        "bare_loop_tokens_per_s": {str(b): bare[b] for b in sizes},
        "bare_loop_runs": {"before": list(bare_before.values()), "after": list(bare_after.values())},
        "pipeline_default": default,
        "sweep": runs,
    }, args.json)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
