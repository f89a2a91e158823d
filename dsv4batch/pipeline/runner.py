"""`run(config)`: the whole `dsv4batch score` or `dsv4batch generate` job (`config.task`).

Order, so that every refusal comes before anything in OUTPUT is deleted or rewritten: INPUT
(files, columns, types, fingerprints) and the model folder, before Ray starts; then the OUTPUT
lease (one writer per OUTPUT); OUTPUT's state and, on --resume, the recorded configuration,
inputs and finished parts; then Ray, the resources the replicas need, the recorded device kind
and the Ray Data id scan (duplicate ids; on --resume the rows already written). Only then is
OUTPUT cleared as planned and `_job.json` written, and the scoring graph runs into the
part-file sink. `_metrics.json` (this run, the total over every run into OUTPUT, and the
history) and `_SUCCESS` are written only after OUTPUT's part files hold exactly one row per
input row. An input with nothing to score (empty, or every row already written) finishes
without starting the pipeline.
"""

from __future__ import annotations

import math
import sys
import time
import uuid

from dsv4batch import __version__
from dsv4batch.jobspec.config import JobConfig
from dsv4batch.jobspec.errors import JobFailed, RowCountError, UsageError
from dsv4batch.jobspec.stats import Written
from dsv4batch.pipeline import output as O

VERBS = {"score": "scoring", "generate": "generating"}


def check_model(model: str, tp: int = 1, weights: str = "stored", tokenizer: str | None = None) -> dict:
    """Every model-folder check, before Ray starts and before OUTPUT is touched: config.json, the
    safetensors headers and routing tables (`loader.check_checkpoint`: bounded by the config's
    sizes) and the tokenizer (`tokenizer.check_tokenizer`: present, or named by `tokenizer`, and
    fitting the vocabulary). Returns what `_job.json` records of the tokenizer; a folder that
    cannot load, or a model that cannot be split `tp` ways, is a `UsageError` naming the problem
    (the config field, for a split)."""
    from dsv4batch.model import ModelLoadError
    from dsv4batch.model.loader import check_checkpoint
    from dsv4batch.model.parallel import SplitError
    from dsv4batch.model.tokenizer import check_tokenizer

    try:
        config = check_checkpoint(model, tp, weights)
        return check_tokenizer(model, tokenizer, config.vocab_size)
    except (ModelLoadError, SplitError) as exc:
        raise UsageError(f"model {model!r}: {exc}") from exc


def run(config: JobConfig, *, log=None) -> dict:
    """Run a scoring or generation job; returns the metrics document also written to `_metrics.json`."""
    from dsv4batch.pipeline.fs import open_fs
    from dsv4batch.pipeline.lease import Lease
    from dsv4batch.pipeline.read import check_input, inspect_input

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if not config.input or not config.output:
        raise UsageError("both INPUT and OUTPUT are required")
    info = inspect_input(config.input, exclude=config.output, input_format=config.input_format,
                         text_columns=config.tokenizer_columns())
    check_input(info, config)
    tokenizer = check_model(config.model, config.tp, config.weights_dtype, config.tokenizer)
    run_id = uuid.uuid4().hex[:8]
    lease = Lease(*open_fs(config.output), run_id, log).acquire()
    try:
        metrics = _run(config, info, {"run_id": run_id, "tokenizer": tokenizer}, log)
    finally:
        lease.release()
    if lease.lost:
        raise JobFailed(f"{lease.lost}; check OUTPUT's part files before resuming")
    return metrics


def _run(config: JobConfig, info, start: dict, log) -> dict:
    """The run after the driver's checks; `start`: {"run_id", "tokenizer": its record}."""
    from dsv4batch.jobspec import schema as S
    from dsv4batch.pipeline.resume import check_config, check_inputs, check_tokenizer

    state = O.inspect_output(config.output, config.overwrite, config.resume)
    job, parts = {}, O.Parts([], 0, None)
    if state.resuming:
        job = check_config(state.job, config, log)
        check_tokenizer(job, start["tokenizer"])
        parts = O.finished_parts(config.output, S.config_output_names(config))
        check_inputs(job, info.fingerprints, config.id_column not in info.schema.names, log)
    run = {"run_id": start["run_id"], "input_rows": info.num_rows, "resumed": state.resuming,
           "model": config.model}
    if info.num_rows == 0:
        if parts.rows:
            raise UsageError(f"INPUT is empty but OUTPUT holds {parts.rows} rows of another run")
        _start(config, info, state, job, start)
        O.write_table(config.output, O.part_name(start["run_id"], 0), _empty_table(config, info))
        return _finish(config, info, _nothing(), 0.0, {**run, "rows_skipped": 0}, job, log)
    return _score(config, info, state, job, parts, run, start, log)


def _start(config: JobConfig, info, state, job: dict, start: dict) -> None:
    """Every check passed: clear OUTPUT as planned, record the run in `_job.json` (`start`:
    {"run_id", "tokenizer": the tokenizer's source, path and sha256})."""
    O.clear_output(state)
    run_id = start["run_id"]
    runs = [*job.get("runs", []), {"run_id": run_id, "resumed": state.resuming,
                                   "started": time.time()}]
    O.write_json(config.output, O.JOB, {
        "writer": O.WRITER, "version": __version__, "run_id": run_id, "input": config.input,
        "result": config.result_fields(), "compute": job.get("compute") or config.compute(),
        "tokenizer": start["tokenizer"], "config": config.to_dict(), "input_rows": info.num_rows,
        "input_files": len(info.files), "id_type": str(info.id_type),
        "inputs": info.fingerprints, "runs": runs})


def _score(config: JobConfig, info, state, job: dict, parts, run: dict, start: dict, log) -> dict:
    import ray

    from dsv4batch.actors.shards import release_groups
    from dsv4batch.pipeline.cluster import configure_data_context, connect
    from dsv4batch.pipeline.faults import explain_failure
    from dsv4batch.pipeline.fs import open_fs
    from dsv4batch.pipeline.graph import check_capacity, process, resolve
    from dsv4batch.pipeline.ids.scan import scan_ids
    from dsv4batch.pipeline.metrics import start_collector
    from dsv4batch.pipeline.progress import Progress
    from dsv4batch.pipeline.read import read
    from dsv4batch.pipeline.resume import check_compute
    from dsv4batch.pipeline.sink import ParquetPartSink

    connect(config.ray_address)
    configure_data_context()
    config = resolve(config)
    check_capacity(config, ray.cluster_resources(), log)
    if state.resuming:
        check_compute(job, config.compute(), config.allow_device_change, log)
    pending = None
    if parts.files or config.id_column in info.schema.names:  # derived ids are unique
        t0 = time.time()
        pending = scan_ids(config, info, parts.files, parts.rows, open_fs(config.output)[0],
                           parts.id_type)
        log(f"[dsv4batch] id scan: {info.num_rows} ids checked, {pending.skipped} already in "
            f"OUTPUT ({time.time() - t0:.1f}s)")
    _start(config, info, state, job, start)
    skipped = pending.skipped if pending else 0
    todo = None if info.num_rows is None else info.num_rows - skipped
    run = {**run, "rows_skipped": skipped}
    if todo == 0:
        return _finish(config, info, _nothing(), 0.0, run, job, log)
    limit = (config.max_errored_rows if config.max_errored_rows is not None
             else math.ceil(todo / 1000) if todo is not None else None)
    log(f"[dsv4batch] {VERBS[config.task]} {todo if todo is not None else 'all'} rows from "
        f"{len(info.files)} file(s) with {config.replicas} replica(s) x "
        + (f"{config.tp} ranks x " if config.tp > 1 else "")
        + f"{config.gpus_per_replica:g} GPU of {config.model!r}"
        + (f" ({skipped} already in OUTPUT)" if skipped else ""))
    collector = start_collector(limit)
    sink = ParquetPartSink(config.output, run_id=run["run_id"], rows_per_file=config.rows_per_file)
    dataset = process(read(config, info, pending if skipped else None), config, stats=collector)
    t0 = time.time()
    try:
        with Progress(collector, todo, enabled=config.progress):
            dataset.write_datasink(sink)
    except Exception as exc:
        release_groups()
        try:
            ledger = ray.get(collector.snapshot.remote(), timeout=30)["ledger"]
        except Exception:  # noqa: BLE001 - the original error is still raised below
            ledger = {}
        raise explain_failure(ledger, exc) from exc
    release_groups()
    snapshot = ray.get(collector.snapshot.remote())
    ray.kill(collector)
    if snapshot["ledger"]["stop"]:  # the last batches passed the limit after every begin
        raise explain_failure(snapshot["ledger"])
    written = sink.result or Written()
    if todo is not None and written.rows != todo:
        raise RowCountError(f"wrote {written.rows} rows for {todo} rows to process")
    return _finish(config, info, (snapshot, written), time.time() - t0,
                   {**run, "max_errored_rows": limit}, job, log)


def _finish(config, info, result, wall: float, extra: dict, job: dict, log) -> dict:
    """Check OUTPUT holds one row per input row, then write `_metrics.json` and `_SUCCESS`."""
    from dsv4batch.pipeline.metrics import accumulate, format_summary, summarize

    snapshot, written = result
    total = O.finished_parts(config.output).rows
    if info.num_rows is not None and total != info.num_rows:
        raise RowCountError(f"OUTPUT's part files hold {total} rows for {info.num_rows} input "
                            "rows; no _SUCCESS written")
    metrics = summarize(snapshot, written, wall,
                        {**extra, "rows_in_output": total, "replicas": config.replicas,
                         "tp": config.tp, "gpus_per_replica": config.gpus_per_replica,
                         "head_precision": config.head_precision, "task": config.task})
    metrics = accumulate(_previous_metrics(config.output) if extra["resumed"] else None, metrics)
    if getattr(config, "output_format", "parquet") == "openai-batch":
        from dsv4batch.model.tokenizer import load_tokenizer, tokenizer_source
        from dsv4batch.pipeline.openai_batch import write_output

        lines = write_output(config.output, load_tokenizer(tokenizer_source(config.model, config.tokenizer)),
                             config.model)
        log(f"[dsv4batch] wrote {lines} response lines to {O.RESULTS}")
    O.write_json(config.output, O.METRICS, metrics)
    O.write_json(config.output, O.SUCCESS, {"run_id": extra["run_id"], "rows": total})
    log(format_summary(metrics))
    return metrics


def _previous_metrics(output: str) -> dict | None:
    try:
        return O.read_json(output, O.METRICS)
    except Exception:  # noqa: BLE001 - none yet (the first run was killed) or unreadable
        return None


def _nothing() -> tuple[dict, Written]:
    from dsv4batch.pipeline.metrics import StatsCollector

    return StatsCollector().snapshot(), Written()


def _empty_table(config: JobConfig, info):
    """A 0-row part file with the output schema, so readers of an empty result get columns."""
    import pyarrow as pa

    from dsv4batch.jobspec import schema as S

    keep = [info.schema.field(c) for c in config.keep_columns]
    return S.config_schema(config, info.id_type or pa.string(), keep).empty_table()
