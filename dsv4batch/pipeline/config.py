"""`ScoreConfig`: the one validated configuration, from the CLI down to every pipeline stage.

Every field is documented in its metadata (the CLI's `--help` is generated from it), values are
checked in `__post_init__`, and `ScoreConfig.from_dict` rejects unknown fields by name. The object
is frozen and picklable, so Ray ships the same instance to tokenize tasks and scoring actors.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from dsv4batch.pipeline.errors import UsageError
from dsv4batch.pipeline.formats import FORMATS
from dsv4batch.pipeline.schema import output_names
from dsv4batch.model.config import HEAD_PRECISIONS  # no torch
from dsv4batch.planner import PLANNER_NAMES  # numpy only: no torch

DTYPES = ("auto", "float32", "bfloat16", "float16")
TRUNCATE = ("none", "left", "right")
WEIGHTS = ("stored", "compute")
STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")  # Ray placement group strategies


def _f(default: Any, help: str, *, choices: tuple | None = None, group: str = "scoring",
       flag: str | None = None, min: float | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "group": group,
                                            "flag": flag, "min": min})


@dataclass(frozen=True)
class ScoreConfig:
    # -- run: used by the runner (`dsv4batch score`), ignored by `pipeline.score(dataset, config)`
    input: str | None = _f(None, "Parquet, JSONL or CSV file, folder of them or glob (any "
                           "filesystem pyarrow can open).", group="run")
    input_format: str | None = _f(None, "Format of INPUT's files; None: by extension (.parquet "
                                  ".pq .parq; .jsonl .json: one JSON object per line; .csv "
                                  "with a header row). Output is always Parquet.",
                                  choices=(None, *FORMATS), group="run")
    output: str | None = _f(None, "Output folder: Parquet part files plus _metrics.json.",
                            group="run")
    overwrite: bool = _f(False, "Replace the files of a previous run in OUTPUT (only files "
                         "dsv4batch wrote; anything else makes the run refuse).", group="run")
    resume: bool = _f(False, "Continue the run in OUTPUT: rows whose id its part files already "
                      "hold are skipped, the rest is scored into new part files. Refused when "
                      "the model, columns or scoring options differ from OUTPUT/_job.json.",
                      group="run")
    rows_per_file: int = _f(10_000, "Rows gathered into one part file (Ray Data's "
                            "min_rows_per_write). A killed run keeps every finished file; "
                            "--resume redoes only the rows of files not yet written.",
                            group="run", min=1)
    ray_address: str | None = _f(None, "Ray cluster to join (e.g. 'auto', 'ray://host:10001'); "
                                 "default: RAY_ADDRESS, else start a local Ray.", group="run")
    progress: bool = _f(True, "Show live progress (rows, tokens/s) on stderr.", group="run")
    allow_device_change: bool = _f(False, "Let --resume continue on another device kind or "
                                   "compute dtype than the one recorded in OUTPUT/_job.json "
                                   "(the dataset then mixes precisions).", group="run")
    # -- model
    model: str = _f("tiny", "Checkpoint folder (transformers save_pretrained layout with "
                    "tokenizer.json) or 'tiny'.", group="model")
    dtype: str = _f("auto", "Compute dtype; auto = bfloat16 on CUDA, float32 on CPU.",
                    choices=DTYPES, group="model")
    weights_dtype: str = _f("stored", "Native FP8/FP4 checkpoint weights: 'stored' keeps them "
                            "quantized in memory (block-scaled matmuls), 'compute' dequantizes "
                            "them to --dtype at load (2-4x the memory).", choices=WEIGHTS,
                            group="model")
    # -- columns and scoring
    text_column: str = _f("prompt", "Column with the text (prompt) to score.")
    target_column: str | None = _f(None, "Optional column with a continuation: only its tokens "
                                   "are scored, conditioned on the prompt (log-likelihood).")
    id_column: str = _f("id", "Column with unique row ids; when the input has no such column, "
                        "ids '<file>:<row>' are derived from file and row position.")
    keep_columns: tuple[str, ...] = _f((), "Input columns to carry through to the output "
                                       "(comma-separated on the CLI).")
    token_logprobs: bool = _f(False, "Also write token_logprobs (list<float32>) per row.")
    top_logprobs: int = _f(0, "Also write the K most likely tokens at every scored position: "
                           "top_ids (list<list<int32>>) and top_logprobs (list<list<float32>>, "
                           "descending). 0: not written.", min=0)
    truncate: str = _f("none", "Rows longer than max_model_len tokens: 'none' answers them with "
                       "an error, 'left' drops their first tokens (bos stays), 'right' their "
                       "last; column truncated_tokens counts what was dropped.", choices=TRUNCATE)
    # -- engine (DSv4Model EngineConfig)
    max_batched_tokens: int = _f(2048, "Query tokens per forward step; long requests span "
                                 "steps, short ones share one.", group="engine", min=1)
    max_model_len: int = _f(8192, "Longest request in tokens (bos + prompt + target); longer "
                            "rows get an error instead of a score.", group="engine", min=2)
    prefill_chunk_size: int | None = _f(None, "Planner workspace budget in requests of maximal "
                                        "length (None: the engine's default).", group="engine",
                                        min=1)
    planner: str = _f("adaptive", "Prefill chunk planner (adaptive: vllm#45061; fixed: chunks of "
                      "prefill_chunk_size).", choices=PLANNER_NAMES, group="engine")
    sort_by_length: bool = _f(True, "Let the engine sort a batch's requests by length.",
                              group="engine")
    head_precision: str = _f("fp32", "The vocabulary head's GEMM on the CPU backend: 'fp32' "
                             "(exact to fp32 rounding) or 'bf16' (opt-in, where the CPU has "
                             "AVX512-BF16 or AMX, else fp32 with a warning: bf16 products summed "
                             "in fp32, each logit rounded to bf16, the softmax in fp32; 1.2-1.5x "
                             "end to end, logprobs within ~1e-2 of fp32 on the seeded models, "
                             "more with larger logits; ties at the max count as greedy, so "
                             "is_greedy can read higher). CUDA ignores it.",
                             choices=HEAD_PRECISIONS, group="engine")
    # -- resources and Ray Data
    replicas: int = _f(1, "Number of scoring actors (model replicas, data parallel).",
                       group="resources", min=1)
    tp: int = _f(1, "Ranks per replica (tensor + expert parallel): the replica's scoring actor "
                 "owns a placement group of TP bundles, one rank worker each, joined in one "
                 "torch.distributed group (NCCL on CUDA, gloo on CPU); each rank holds its "
                 "slice of the weights. GPUs used = replicas x tp x gpus_per_replica.",
                 group="resources", min=1)
    placement_strategy: str = _f("PACK", "Ray placement strategy of a --tp > 1 replica's bundles "
                                 "(PACK: one node when it can; STRICT_PACK: one node or wait).",
                                 choices=STRATEGIES, group="resources")
    gpus_per_replica: float | None = _f(None, "GPUs per rank of a replica (per actor at --tp 1); "
                                        "None: 1 when the cluster has GPUs, else 0 (CPU "
                                        "backend).", group="resources", min=0)
    cpus_per_replica: float | None = _f(None, "CPUs reserved per rank of a replica (per actor "
                                        "at --tp 1); None: 1 with GPUs; on the CPU backend an "
                                        "equal share of what the tokenizers and 1 CPU for "
                                        "read/write tasks leave, at most 0.5 (a reservation "
                                        "only schedules: threads are --torch-threads).",
                                        group="resources", min=0)
    torch_threads: int | None = _f(None, "torch intra-op threads in each actor (each rank) on "
                                   "the CPU backend; None: its share of a node's CPUs (the "
                                   "node's CPUs / the ranks on it, at least 1), so the actors "
                                   "together use the node's cores.", group="resources", min=1)
    batch_size: int = _f(32, "Rows per Ray Data batch sent to an actor.", group="resources",
                         min=1)
    batches_in_flight: int = _f(2, "Batches queued per actor (>= 2 overlaps data transfer "
                                "with compute).", group="resources", min=1)
    tokenize_batch_size: int = _f(256, "Rows per tokenize batch.", group="resources", min=1)
    tokenize_num_cpus: float = _f(0.25, "CPUs reserved per tokenize actor.", group="resources",
                                  min=0)
    tokenize_concurrency: int = _f(2, "Most tokenize actors (the pool autoscales from 1).",
                                   group="resources", min=1)
    max_block_mib: float = _f(4.0, "Largest Ray Data block, in MiB (the dataset's "
                              "DataContext.target_max_block_size): read and tokenize stream "
                              "blocks of at most this size, so an actor's memory does not grow "
                              "with the input. Ray's default, 128 MiB, is millions of short "
                              "prompts per block (Ray's Parquet reader packs small files and row "
                              "groups into one read task and ignores override_num_blocks).",
                              group="resources", min=0.0625)
    max_buffered_mib: float | None = _f(None, "Ray Data's object store budget for the run "
                                        "(ExecutionOptions.resource_limits): how much read, "
                                        "tokenized and scored data may wait between steps. "
                                        "Without it the tokenizer runs ahead of the model "
                                        "through the whole input, and small blocks (< 100 KiB) "
                                        "wait in the driver's memory. None: 4 x max_block_mib "
                                        "+ 16 per replica.", group="resources", min=1)
    gpu_memory_gib: float | None = _f(None, "Memory of one GPU, for the capacity check before any "
                                      "actor starts (`dsv4batch plan`'s arithmetic: a replica "
                                      "whose weights, workspace and activations do not fit is "
                                      "refused). None: from Ray's accelerator_type when it is a "
                                      "known GPU, else no check.", group="resources", min=0.001)
    wait_for_resources: bool = _f(False, "Start even when the cluster lacks the GPUs or CPUs "
                                  "the replicas need right now (an autoscaler will add nodes); "
                                  "without it such a run is refused up front.",
                                  group="resources")
    # -- faults
    max_errored_rows: int | None = _f(None, "Most rows whose scoring failed (a batch that kept "
                                      "failing, an engine error) before the job stops (exit 1); "
                                      "input problems such as null or too-long text are answers "
                                      "and do not count. None: 0.1% of the rows to score, rounded "
                                      "up (the Python API: unlimited).", group="faults", min=0)
    max_batch_attempts: int = _f(3, "Attempts at a batch (actor crashes and engine exceptions "
                                 "included) before its rows get an error instead of a score.",
                                 group="faults", min=1)
    max_actor_restarts: int = _f(4, "Times Ray restarts a scoring actor whose process died "
                                 "(crash, OOM kill, lost node), its batches retried on the new "
                                 "one; then the job stops (resume it). -1: unlimited, which also "
                                 "restarts an actor that dies while loading the model forever. "
                                 "A model that raises while loading stops the job at once.",
                                 group="faults", min=-1)

    collective_timeout_s: float = _f(300.0, "A collective between the ranks of a --tp replica "
                                     "(one rank dead or stopped) fails after this many seconds; "
                                     "the replica's ranks are restarted and the batch retried.",
                                     group="faults", min=1)
    batch_timeout_s: float = _f(1800.0, "A batch still running after this many seconds (a "
                                "stopped or hung actor) has its actor killed; Ray restarts it "
                                "and the batch is retried like a crash.", group="faults", min=1)

    def __post_init__(self) -> None:
        if isinstance(self.keep_columns, (list, str)):
            kc = self.keep_columns.split(",") if isinstance(self.keep_columns, str) else self.keep_columns
            object.__setattr__(self, "keep_columns", tuple(c.strip() for c in kc if c.strip()))
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and _allows(hints[f.name], float):
                object.__setattr__(self, f.name, value := float(value))
            if not _isinstance(value, hints[f.name]):
                raise UsageError(f"config field {f.name!r}: expected {_tname(hints[f.name])}, "
                                 f"got {value!r}")
            choices, lo = f.metadata["choices"], f.metadata["min"]
            if choices and value not in choices:
                raise UsageError(f"config field {f.name!r}: {value!r} is not one of {choices}")
            if isinstance(value, float) and not math.isfinite(value):
                raise UsageError(f"config field {f.name!r}: must be a finite number, got {value!r}")
            if lo is not None and value is not None and value < lo:
                raise UsageError(f"config field {f.name!r}: must be >= {lo}, got {value!r}")
        if self.resume and self.overwrite:
            raise UsageError("--resume continues the run in OUTPUT, --overwrite replaces it: "
                             "give one of them")
        if self.target_column is not None and self.target_column == self.text_column:
            raise UsageError("target_column must differ from text_column")
        if self.id_column in self.keep_columns:
            raise UsageError(f"keep_columns: the id column {self.id_column!r} is always written "
                             "(as 'id'); do not list it")
        clash = set(self.keep_columns) & set(output_names(True, True, 1))
        if clash:
            raise UsageError(f"keep_columns {sorted(clash)} clash with output columns; rename "
                             "them in the input")

    def compute(self) -> dict[str, str]:
        """{"device": "cuda" | "cpu", "dtype": the resolved compute dtype} the replicas use
        (after `graph.resolve` filled in `gpus_per_replica`); recorded in `_job.json`."""
        device = "cuda" if (self.gpus_per_replica or 0) > 0 else "cpu"
        return {"device": device, "dtype": resolved_dtype(self.dtype, device)}

    def buffer_bytes(self) -> int:
        """`max_buffered_mib` in bytes, with its default filled in."""
        mib = self.max_buffered_mib
        if mib is None:
            mib = 4 * self.max_block_mib + 16 * self.replicas
        return int(mib * 2**20)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ScoreConfig":
        """Build from a mapping; unknown keys are rejected with a suggestion."""
        known = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in known:
                hint = difflib.get_close_matches(key, known, n=1)
                raise UsageError(f"unknown config field {key!r}"
                                 + (f" (did you mean {hint[0]!r}?)" if hint else ""))
        return cls(**d)

    def replace(self, **changes: Any) -> "ScoreConfig":
        return self.from_dict({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["keep_columns"] = list(self.keep_columns)
        return d

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `dsv4batch.model.EngineConfig`."""
        kw = dict(max_num_batched_tokens=self.max_batched_tokens, max_model_len=self.max_model_len,
                  planner=self.planner, sort_by_length=self.sort_by_length,
                  head_precision=self.head_precision)
        if self.prefill_chunk_size is not None:
            kw["prefill_chunk_size"] = self.prefill_chunk_size
        return kw

    def result_fields(self) -> dict[str, Any]:
        """The fields that change what a row's output is (recorded per run, checked on resume)."""
        keys = ("model", "dtype", "text_column", "target_column", "id_column", "keep_columns",
                "token_logprobs", "top_logprobs", "max_model_len", "truncate", "head_precision")
        return {k: v for k, v in self.to_dict().items() if k in keys}


def resolved_dtype(name: str, device: str) -> str:
    """`--dtype` on `device`: auto = bfloat16 on CUDA, float32 on the CPU backend."""
    if name == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    return name


def _allows(hint: Any, t: type) -> bool:
    return hint is t or t in typing.get_args(hint)


def _isinstance(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        return isinstance(value, tuple) and all(_isinstance(v, args[0]) for v in value)
    if args:  # Optional / Union
        return any(_isinstance(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, hint)


def _tname(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple:
        return f"tuple of {_tname(args[0])}"
    if args:
        return " | ".join(_tname(a) for a in args)
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))
