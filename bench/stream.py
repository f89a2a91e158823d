"""Streaming: the driver's and each actor's peak RSS stay flat as rows grow 10x, and the resume
scan's time and memory over already-written ids.

Two pipelines, each at N/10 and N rows of short prompts, every run in a fresh process (each
its own driver and actors):

* `stream`: the whole graph (read -> tokenize actors -> ScoringActor -> part-file sink, ledger
  and metrics actor) with the actor's model replaced by `ZeroEngine` (log p = 0 per token): the
  tiny model scores a few hundred tokens/s on 2 CPUs, far too slow for 1M rows, so this run
  measures everything around the forward. Output says `"scorer": "zero-model"`.
* `model`: the same graph with the real `tiny` model, at `--model-rows` / 10 and `--model-rows`.

Then the `--resume` id scan (Ray Data) over the N-row input and the N ids the stream run wrote:
its time and the driver's memory, again at N/10 and N.

Memory is sampled from /proc every 0.5 s, per process: private memory (RssAnon: the Python
heap, Arrow buffers; where accumulation would show) and total RSS. Total RSS also counts the
pages of Ray's shared-memory object store a process has touched (RssShmem), which grow while
blocks pass through the store's arena and are not the process's own. Driver: peak minus the
value just before the run, and its growth in the run's second half (`private_second_half`:
accumulation keeps growing, a full buffer does not). Actors (Ray titles their processes
`ray::<class>`): the largest peak per class.

The driver holds the blocks that wait between steps when they are small (Ray keeps objects
under 100 KiB in the owner's memory, not in the shared store): their volume is bounded by
`max_buffered_mib`, so driver memory is flat from N/10 to N once N/10 rows fill that buffer
(`--max-buffered-mib 8 --max-block-mib 1` shows it at N = 1M short prompts; the defaults fill it
at ~600k).

    python -m dsv4batch.bench stream --rows 1000000 --json [--model-rows 2000]
        [--max-block-mib MIB] [--max-buffered-mib MIB]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from bench.common import emit
from dsv4batch.actors.score import ScoringActor
from dsv4batch.model.stats import StepStats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILE_ROWS = 100_000
WORDS = ("the of and to in is was for on that with as by at from his it an were are which this "
         "be or has had not first one their its new after who they have her she two been other "
         "when there all during into school time may years more most only over city some world "
         "would where later up such used many can state about national out known university "
         "united then made").split()


class ZeroEngine:
    """Stands in for the `Engine` in the `stream` run: every scored token gets log p = 0."""

    head_precision = "none"  # no head runs

    def score_details(self, requests, top_k: int = 0):
        """`Engine.score_details`' shapes: log p = 0, never the argmax, top-K of zeros."""
        from dsv4batch.model import TokenScores

        def zeros(n):
            return TokenScores(np.zeros(n, np.float32), np.zeros(n, bool),
                               np.zeros((n, top_k), np.int32), np.zeros((n, top_k), np.float32))

        return [zeros(len(r) - 1) for r in requests], StepStats(model_calls=1)


class ZeroScorer(ScoringActor):
    """`ScoringActor` (ledger, outputs, telemetry: all of it) around `ZeroEngine`."""

    load = staticmethod(lambda config, num_gpus: (ZeroEngine(), "cpu", "none"))


def write_input(folder: str, rows: int, seed: int = 0) -> None:
    """`rows` short prompts (3 to 12 words) with int64 ids, in files of FILE_ROWS rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    for start in range(0, rows, FILE_ROWS):
        n = min(FILE_ROWS, rows - start)
        lengths = rng.integers(3, 13, n)
        flat = words[rng.integers(0, len(words), int(lengths.sum()))]
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        texts = [" ".join(flat[bounds[i]:bounds[i + 1]]) for i in range(n)]
        pq.write_table(pa.table({"id": np.arange(start, start + n), "prompt": texts}),
                       os.path.join(folder, f"part-{start // FILE_ROWS:05d}.parquet"))


def _status(pid: int | str, key: str) -> int:
    """A /proc/<pid>/status memory field in bytes (0 if the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _descendants(root: int) -> set[str]:
    """Pids under `root` (the Ray this driver started: its raylet and the raylet's workers)."""
    children: dict[str, list[str]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [str(root)]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


class ActorSampler(threading.Thread):
    """Every 0.5 s: private and total RSS of this driver and of each `ray::` actor process of
    its Ray, the largest per class (other Ray instances on the machine are not counted)."""

    CLASSES = ("MapWorker(MapBatches(Tokenize))", "MapWorker(MapBatches(ZeroScorer))",
               "MapWorker(MapBatches(ScoringActor))", "StatsCollector")

    def __init__(self):
        super().__init__(daemon=True)
        self.peaks: dict[str, dict[str, int]] = {}
        self.driver_timeline: list[int] = []  # driver private memory per sample
        self.done = threading.Event()

    def _record(self, name: str, pid) -> None:
        peak = self.peaks.setdefault(name, {"private": 0, "rss": 0})
        peak["private"] = max(peak["private"], _status(pid, "RssAnon"))
        peak["rss"] = max(peak["rss"], _status(pid, "VmRSS"))

    def sample(self) -> None:
        self._record("driver", "self")
        self.driver_timeline.append(_status("self", "RssAnon"))
        for pid in _descendants(os.getpid()):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    title = f.read().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            name = next((c for c in self.CLASSES if title.startswith(f"ray::{c}")), None)
            if name:
                self._record(name, pid)

    def run(self) -> None:
        while not self.done.wait(0.5):
            self.sample()

    def report(self, before: dict) -> dict:
        """MiB: the driver's growth over `before`, each actor class's peak."""
        mib = {k: {m: round(v / 2**20, 1) for m, v in p.items()} for k, p in self.peaks.items()}
        driver = self.peaks.get("driver", before)
        mib["driver_growth"] = {m: round((driver[m] - before[m]) / 2**20, 1) for m in before}
        mib.pop("driver", None)
        # accumulation keeps growing to the end; a bounded buffer stops growing once full
        line = self.driver_timeline
        if len(line) >= 4:
            mib["driver_growth"]["private_second_half"] = round(
                (max(line) - max(line[:len(line) // 2])) / 2**20, 1)
        return mib


def _ray(cpus: int) -> None:
    import ray

    from dsv4batch.pipeline.cluster import configure_data_context

    # the workers import ZeroScorer from this repository's bench package
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    configure_data_context()


def child_run(mode: str, src: str, out: str, batch_size: int, block_mib: float | None,
              buffer_mib: float | None) -> dict:
    """One pipeline run in this (fresh) process: rows/s and peak memory."""
    from dsv4batch.jobspec.config import ScoreConfig
    from dsv4batch.pipeline.graph import resolve, score
    from dsv4batch.pipeline.metrics import start_collector
    from dsv4batch.pipeline.read import check_input, inspect_input, read
    from dsv4batch.pipeline.sink import ParquetPartSink

    _ray(os.cpu_count())
    info = inspect_input(src)
    # blocks of at most ScoreConfig.max_block_mib at N/10 and N alike
    config = resolve(ScoreConfig(input=src, output=out, model="tiny", progress=False,
                                 torch_threads=1, batch_size=batch_size if mode == "stream"
                                 else ScoreConfig.batch_size,
                                 max_block_mib=block_mib or ScoreConfig.max_block_mib,
                                 max_buffered_mib=buffer_mib))
    check_input(info, config)
    collector = start_collector()
    sink = ParquetPartSink(out, rows_per_file=config.rows_per_file)
    sampler = ActorSampler()
    before = {"private": _status("self", "RssAnon"), "rss": _status("self", "VmRSS")}
    sampler.start()
    t0 = time.time()
    score(read(config, info), config, stats=collector,
          scorer=ZeroScorer if mode == "stream" else None).write_datasink(sink)
    wall = time.time() - t0
    sampler.done.set()
    sampler.join()
    return {"rows": sink.result.rows, "input_tokens": sink.result.input_tokens,
            "max_block_mib": config.max_block_mib,
            "max_buffered_mib": round(config.buffer_bytes() / 2**20, 2),
            "part_files": len(sink.result.files),
            "wall_s": round(wall, 2),
            "rows_per_s": round(sink.result.rows / wall, 1),
            "memory_mib": sampler.report(before)}


def child_scan(src: str, out: str) -> dict:
    """The --resume id scan over INPUT and the ids OUTPUT holds: time and driver memory."""
    from dsv4batch.jobspec.config import ScoreConfig
    from dsv4batch.pipeline.fs import open_fs
    from dsv4batch.pipeline.ids.scan import scan_ids
    from dsv4batch.pipeline.output import finished_parts
    from dsv4batch.pipeline.read import inspect_input

    _ray(os.cpu_count())
    config = ScoreConfig(input=src, output=out)
    info, parts = inspect_input(src), finished_parts(out)
    sampler = ActorSampler()
    before = {"private": _status("self", "RssAnon"), "rss": _status("self", "VmRSS")}
    sampler.start()
    t0 = time.time()
    pending = scan_ids(config, info, parts.files, parts.rows, open_fs(out)[0], parts.id_type)
    wall = time.time() - t0
    sampler.done.set()
    sampler.join()
    return {"input_rows": info.num_rows, "ids_in_output": parts.rows,
            "skipped": pending.skipped, "files_left_to_read": len(pending.files),
            "wall_s": round(wall, 2), "ids_per_s": round((info.num_rows + parts.rows) / wall),
            "driver_growth_mib": sampler.report(before)["driver_growth"]}


def spawn(args: argparse.Namespace, *child) -> dict:
    """One child run in a fresh process, with this run's batch and block settings."""
    flags = [f"--batch-size={args.batch_size}"]
    flags += [f"--max-block-mib={args.max_block_mib}"] if args.max_block_mib else []
    flags += [f"--max-buffered-mib={args.max_buffered_mib}"] if args.max_buffered_mib else []
    cmd = [sys.executable, "-m", "dsv4batch.bench", "stream", *flags, "--child", *map(str, child)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _flatness(small: dict, big: dict) -> dict:
    """Peak at N over peak at N/10, per process and measure (1.0: flat)."""
    out = {}
    for name, peaks in big.items():
        for m, v in peaks.items():
            base = small.get(name, {}).get(m)
            if base:
                out[f"{name}.{m}"] = round(v / base, 2)
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rows", type=int, default=1_000_000, help="N of the stream run")
    parser.add_argument("--model-rows", type=int, default=2000,
                        help="N of the tiny-model run (0: skip it)")
    parser.add_argument("--batch-size", type=int, default=256,
                        help="rows per scoring batch in the stream run (with no forward, Ray's "
                             "per-batch cost would dominate at the default 32); the model run "
                             "uses the default")
    parser.add_argument("--max-block-mib", type=float, default=None,
                        help="ScoreConfig.max_block_mib of both runs (default: the config's)")
    parser.add_argument("--max-buffered-mib", type=float, default=None,
                        help="ScoreConfig.max_buffered_mib of both runs (default: the config's). "
                             "Memory is flat from N/10 to N only once N/10 rows fill the buffer")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        result = (child_scan(*rest) if kind == "scan" else
                  child_run(kind, *rest, args.batch_size, args.max_block_mib,
                            args.max_buffered_mib))
        print(json.dumps(result))
        return

    tmp = tempfile.mkdtemp(prefix="dsv4batch-stream-")
    try:
        result = {"cpus": os.cpu_count(), "stream_batch_size": args.batch_size,
                  "max_block_mib": args.max_block_mib, "max_buffered_mib": args.max_buffered_mib,
                  "scorer": {"stream": "zero-model (ScoringActor around log p = 0; the tiny "
                                       "model is too slow for this many rows on this machine)",
                             "model": "tiny"}}
        for mode, n in (("stream", args.rows), ("model", args.model_rows)):
            runs = {}
            for rows in (n // 10, n) if n else ():
                src, out = f"{tmp}/{mode}-{rows}-in", f"{tmp}/{mode}-{rows}-out"
                write_input(src, rows)
                runs[rows] = spawn(args, mode, src, out)
                if mode == "stream":
                    runs[rows]["resume_scan"] = spawn(args, "scan", src, out)
                shutil.rmtree(src if mode == "model" else tmp + "/none", ignore_errors=True)
            if n == 0:
                continue
            small, big = runs[n // 10], runs[n]
            result[mode] = {"runs": {str(k): v for k, v in runs.items()},
                            "ratio_10x": _flatness(small["memory_mib"], big["memory_mib"])}
            if mode == "stream":
                result["resume_scan_ratio_10x"] = _flatness(
                    {"driver": small["resume_scan"]["driver_growth_mib"]},
                    {"driver": big["resume_scan"]["driver_growth_mib"]})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    emit(result, args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
