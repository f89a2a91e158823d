"""The whole `dsv4batch score` job: validate, read, score, write, account for every row.

Order matters for the user: paths, columns and OUTPUT are checked before Ray starts (a
`UsageError` is exit code 2), `_job.json` is written before scoring, `_metrics.json` and
`_SUCCESS` only after the written row count equals the input's.
"""

from __future__ import annotations

import sys
import time
import uuid

from dsv4batch import __version__
from dsv4batch.pipeline import output as O
from dsv4batch.pipeline.config import ScoreConfig, UsageError


class RowCountError(RuntimeError):
    """The written rows do not match the input rows (the row contract is broken)."""


def run(config: ScoreConfig, *, log=None) -> dict:
    """Run a scoring job; returns the metrics document also written to `_metrics.json`."""
    import ray

    from dsv4batch.pipeline.cluster import configure_data_context, connect
    from dsv4batch.pipeline.graph import resolve, score
    from dsv4batch.pipeline.metrics import format_summary, start_collector, summarize
    from dsv4batch.pipeline.progress import Progress
    from dsv4batch.pipeline.read import check_input, inspect_input, read
    from dsv4batch.pipeline.sink import ParquetPartSink

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if not config.input or not config.output:
        raise UsageError("both INPUT and OUTPUT are required")
    info = inspect_input(config.input)
    check_input(info, config)
    check_model(config.model)
    O.prepare_output(config.output, config.overwrite)
    run_id = uuid.uuid4().hex[:8]
    connect(config.ray_address)
    configure_data_context()
    config = resolve(config)
    O.write_json(config.output, O.JOB, {"version": __version__, "run_id": run_id,
                                       "input": config.input, "result": config.result_fields(),
                                       "config": config.to_dict(), "input_rows": info.num_rows,
                                       "input_files": len(info.files)})
    log(f"[dsv4batch] scoring {info.num_rows} rows from {len(info.files)} file(s) with "
        f"{config.replicas} replica(s) x {config.gpus_per_replica:g} GPU of {config.model!r}")
    collector = start_collector()
    sink = ParquetPartSink(config.output, run_id=run_id)
    dataset = score(read(config, info), config, stats=collector)
    t0 = time.time()
    with Progress(collector, info.num_rows, enabled=config.progress):
        dataset.write_datasink(sink)
    wall = time.time() - t0
    snapshot = ray.get(collector.snapshot.remote())
    ray.kill(collector)
    metrics = summarize(snapshot, sink.result or _empty(), wall,
                        {"run_id": run_id, "input_rows": info.num_rows, "model": config.model,
                         "replicas": config.replicas,
                         "gpus_per_replica": config.gpus_per_replica})
    if info.num_rows is not None and metrics["rows"] != info.num_rows:
        raise RowCountError(f"wrote {metrics['rows']} rows for {info.num_rows} input rows")
    O.write_json(config.output, O.METRICS, metrics)
    O.write_json(config.output, O.SUCCESS, {"run_id": run_id, "rows": metrics["rows"]})
    log(format_summary(metrics))
    return metrics


def check_model(model: str) -> None:
    """A local checkpoint folder must hold a DeepSeek-V4 config.json (checked before Ray starts;
    each actor still validates the weights it loads)."""
    if model == "tiny" or "://" in model:
        return
    from dsv4batch.model.config import ModelLoadError, load_config

    try:
        load_config(model)
    except ModelLoadError as exc:
        raise UsageError(str(exc)) from exc


def _empty() -> dict:
    return {"rows": 0, "rows_errored": 0, "input_tokens": 0, "scored_tokens": 0, "files": []}
