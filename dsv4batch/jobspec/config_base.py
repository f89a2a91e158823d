"""What every job's configuration shares: `JobConfig`, its documented fields and their checks.

`JobConfig` holds what every job shares (INPUT and OUTPUT, the model, the engine, resources,
faults); the jobs' own configurations (`ScoreConfig`, `GenerateConfig`) extend it in `config`,
the module every caller imports from. `_f` makes a documented field (`description`; `--help` is
generated from it, grouped by `json_schema_extra["group"]`; fields marked `cli: False` are
Python-only: benchmark and debug knobs); `explain` turns pydantic's errors into the one
`UsageError` line naming the field.
"""

from __future__ import annotations

import difflib
from typing import Any, ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dsv4batch.jobspec.errors import UsageError
from dsv4batch.model.config import ATTN_BACKENDS, HEAD_PRECISIONS  # no torch
from dsv4batch.planner import PLANNER_NAMES  # numpy only: no torch

# the input formats and their file extensions; openai-batch: JSONL request lines (`pipeline.openai_batch`),
# only by --input-format (no extension of its own)
FORMATS = {"parquet": (".parquet", ".pq", ".parq"), "json": (".jsonl", ".json"), "csv": (".csv",),
           "openai-batch": ()}
FORMAT_NAMES = tuple(FORMATS)
DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHTS = ("stored", "compute")
STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")  # Ray placement group strategies
MAX_GPU_MEMORY_GIB = 2**20  # 1 PiB: far above any GPU; keeps byte counts finite integers
MAX_MIB = 2**30  # a MiB budget (1 PiB); larger is no budget but an overflow
MAX_TIMEOUT_S = 10**7  # 116 days
GROUPS = {"run": "run", "model": "model", "columns": "columns and outputs", "generation": "generation",
          "engine": "engine", "resources": "resources and Ray Data", "faults": "fault tolerance"}


def _f(default: Any, help: str, *, group: str = "columns", cli: bool = True, **kw) -> Any:
    """A documented field: `help` is its --help text, `group` its --help section."""
    return Field(default, description=help, json_schema_extra={"group": group, "cli": cli}, **kw)


class JobConfig(BaseModel):
    """What every dsv4batch job shares; see `ScoreConfig` and `GenerateConfig`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
    task: str = "job"  # overridden by each job's class (not a field users set)

    # -- run: used by the runner (`dsv4batch score|generate`), ignored by the Python graph API
    input: Optional[str] = _f(None, "Parquet, JSONL or CSV file, folder of them or glob (any filesystem pyarrow "
                              "can open).", group="run")
    input_format: Optional[Literal[FORMAT_NAMES]] = _f(None, "Format of INPUT's files; None: by extension (.parquet "
                                                  ".pq .parq; .jsonl .json: one JSON object per line; .csv with a "
                                                  "header row). Output is always Parquet.", group="run")
    output: Optional[str] = _f(None, "Output folder: Parquet part files plus _job.json, _metrics.json and "
                               "_SUCCESS.", group="run")
    overwrite: bool = _f(False, "Replace the files of a previous run in OUTPUT (only files dsv4batch wrote; "
                         "anything else makes the run refuse).", group="run")
    resume: bool = _f(False, "Continue the run in OUTPUT: rows whose id its part files already hold are "
                      "skipped, the rest is processed into new part files. Refused when the model, columns "
                      "or options that change a row's result differ from OUTPUT/_job.json.", group="run")
    rows_per_file: int = _f(10_000, "Rows gathered into one part file (Ray Data's min_rows_per_write). A killed "
                            "run keeps every finished file; --resume redoes only the rows of files not yet "
                            "written.", group="run", ge=1)
    ray_address: Optional[str] = _f(None, "Ray cluster to join (e.g. 'auto', 'ray://host:10001'); default: "
                                    "RAY_ADDRESS, else start a local Ray.", group="run")
    progress: bool = _f(True, "Show live progress (rows, tokens/s) on stderr.", group="run")
    allow_device_change: bool = _f(False, "Let --resume continue on another device kind or compute dtype than "
                                   "the one recorded in OUTPUT/_job.json (the dataset then mixes precisions).",
                                   group="run")
    # -- model
    model: str = _f("tiny", "Checkpoint folder (transformers save_pretrained layout with tokenizer.json) or "
                    "'tiny'.", group="model")
    tokenizer: Optional[str] = _f(None, "The tokenizer: a tokenizer.json file, a folder holding one, or 'dsv4' (the "
                                  "DSv4 tokenizer packaged with dsv4batch). None: the model folder's "
                                  "tokenizer.json; a folder without one is refused ('tiny' uses the packaged "
                                  "one). A tokenizer with ids past the model's vocab_size is refused; _job.json "
                                  "records its source and sha256.", group="model")
    dtype: Literal[DTYPES] = _f("auto", "Compute dtype; auto = bfloat16 on CUDA, float32 on CPU.", group="model")
    weights_dtype: Literal[WEIGHTS] = _f("stored", "Native FP8/FP4 checkpoint weights: 'stored' keeps them "
                                         "quantized in memory (block-scaled matmuls), 'compute' dequantizes them "
                                         "to --dtype at load (2-4x the memory).", group="model")
    # -- columns
    text_column: str = _f("prompt", "Column with the text (prompt) of each row.")
    id_column: str = _f("id", "Column with unique row ids; when the input has no such column, ids "
                        "'<file>:<row>' are derived from file and row position.")
    keep_columns: tuple[str, ...] = _f((), "Input columns to carry through to the output (comma-separated "
                                       "on the CLI).")
    messages_column: Optional[str] = _f(None, "Column with a conversation per row (a list of {role, content} "
                                        "messages, or its JSON text) instead of --text-column: generate renders "
                                        "it with the DSv4 chat encoding and opens the assistant's turn; score "
                                        "scores the last assistant message given the conversation before it. A "
                                        "malformed conversation is that row's error.")
    thinking: bool = _f(False, "With --messages-column: DSv4's thinking mode (the assistant's turn opens with "
                        "<think>, and the last turn's reasoning is kept) instead of chat mode.")
    # -- engine (DSv4Model EngineConfig)
    max_batched_tokens: int = _f(2048, "Query tokens per forward step; long requests span steps, short ones "
                                 "share one.", group="engine", ge=1)
    max_model_len: int = _f(8192, "Longest request in tokens; longer rows get an error instead of a result.",
                            group="engine", ge=2)
    prefill_chunk_size: Optional[int] = _f(None, "Planner workspace budget in requests of maximal length "
                                           "(None: the engine's default, vLLM's 4).", group="engine", ge=1)
    attn_backend: Literal[ATTN_BACKENDS] = _f("auto", "Sparse attention kernel: auto (FlashMLA on a GPU that "
                                              "fits it, else Triton on a GPU, else the CPU kernel where it "
                                              "builds, else torch), or force torch / cpu / flashmla / triton "
                                              "(refused where it cannot run).",
                                              group="engine")
    head_precision: Literal[HEAD_PRECISIONS] = _f(
        "fp32", "The vocabulary head's GEMM on the CPU backend: 'fp32' (exact to fp32 rounding) or 'bf16' "
        "(opt-in, where the CPU has AVX512-BF16 or AMX, else fp32 with a warning: bf16 products summed in fp32, "
        "each logit rounded to bf16, the softmax in fp32; 1.2-1.5x end to end, logprobs within ~1e-2 of fp32 on "
        "the seeded models, more with larger logits; ties at the max count as greedy, so is_greedy can read "
        "higher). CUDA ignores it.", group="engine")
    planner: Literal[PLANNER_NAMES] = _f("adaptive", "Prefill chunk planner (adaptive: vllm#45061; fixed, dp, "
                                         "single: the baselines of `python -m dsv4batch.bench planner`).",
                                         group="engine", cli=False)
    sort_by_length: bool = _f(True, "Let the engine sort a batch's requests by length (scoring).",
                              group="engine", cli=False)
    # -- resources and Ray Data
    replicas: int = _f(1, "Number of model replicas (data parallel actors).", group="resources", ge=1)
    tp: int = _f(1, "Ranks per replica (tensor + expert parallel): the replica's actor owns a placement group "
                 "of TP bundles, one rank worker each, joined in one torch.distributed group (NCCL on CUDA, "
                 "gloo on CPU); each rank holds its slice of the weights. GPUs used = replicas x tp x "
                 "gpus_per_replica.", group="resources", ge=1)
    placement_strategy: Literal[STRATEGIES] = _f("PACK", "Ray placement strategy of a --tp > 1 replica's "
                                                 "bundles (PACK: one node when it can; STRICT_PACK: one node or "
                                                 "wait).", group="resources")
    gpus_per_replica: Optional[float] = _f(None, "GPUs per rank of a replica (per actor at --tp 1); None: 1 when "
                                           "the cluster has GPUs, else 0 (CPU backend).", group="resources", ge=0)
    cpus_per_replica: Optional[float] = _f(None, "CPUs reserved per rank of a replica (per actor at --tp 1); "
                                           "None: 1 with GPUs; on the CPU backend an equal share of what the "
                                           "tokenizers and 1 CPU for read/write tasks leave, at most 0.5 (a "
                                           "reservation only schedules: threads are --torch-threads).",
                                           group="resources", ge=0, le=1e6)
    torch_threads: Optional[int] = _f(None, "torch intra-op threads in each actor (each rank) on the CPU "
                                      "backend; None: its share of a node's CPUs (the node's CPUs / the ranks on "
                                      "it, at least 1), so the actors together use the node's cores.",
                                      group="resources", ge=1)
    batch_size: int = _f(32, "Rows per Ray Data batch sent to an actor.", group="resources", ge=1)
    batches_in_flight: int = _f(2, "Batches queued per actor (>= 2 overlaps data transfer with compute).",
                                group="resources", ge=1)
    tokenize_batch_size: int = _f(256, "Rows per tokenize batch.", group="resources", ge=1)
    tokenize_num_cpus: float = _f(0.25, "CPUs reserved per tokenize actor.", group="resources", ge=0)
    tokenize_concurrency: int = _f(2, "Most tokenize actors (the pool autoscales from 1).", group="resources",
                                   ge=1)
    max_block_mib: float = _f(4.0, "Largest Ray Data block, in MiB (the dataset's "
                              "DataContext.target_max_block_size): read and tokenize stream blocks of at most "
                              "this size, so an actor's memory does not grow with the input. Ray's default, 128 "
                              "MiB, is millions of short prompts per block.", group="resources", ge=0.0625,
                              le=MAX_MIB)
    max_buffered_mib: Optional[float] = _f(None, "Ray Data's object store budget for the run "
                                           "(ExecutionOptions.resource_limits): how much read, tokenized and "
                                           "finished data may wait between steps. None: 4 x max_block_mib + 16 "
                                           "per replica.", group="resources", ge=1, le=MAX_MIB)
    gpu_memory_gib: Optional[float] = _f(None, "Memory of one GPU, for the capacity check before any actor "
                                         "starts (`dsv4batch plan`'s arithmetic). None: from Ray's "
                                         "accelerator_type when it is a known GPU, else no check.",
                                         group="resources", ge=0.001, le=MAX_GPU_MEMORY_GIB)
    wait_for_resources: bool = _f(False, "Start even when the cluster lacks the GPUs or CPUs the replicas need "
                                  "right now (an autoscaler will add nodes); without it such a run is refused up "
                                  "front.", group="resources")
    # -- faults
    max_errored_rows: Optional[int] = _f(None, "Most rows whose processing failed (a batch that kept failing, "
                                         "an engine error) before the job stops (exit 1); input problems such "
                                         "as null or too-long text are answers and do not count. None: 0.1% of "
                                         "the rows to process, rounded up (the Python API: unlimited).",
                                         group="faults", ge=0)
    max_batch_attempts: int = _f(3, "Attempts at a batch (actor crashes and engine exceptions included) before "
                                 "its rows get an error instead of a result.", group="faults", ge=1)
    max_actor_restarts: int = _f(4, "Times Ray restarts an actor whose process died (crash, OOM kill, lost "
                                 "node), its batches retried on the new one; then the job stops (resume it). -1: "
                                 "unlimited, which also restarts an actor that dies while loading the model "
                                 "forever. A model that raises while loading stops the job at once.",
                                 group="faults", ge=-1)
    collective_timeout_s: float = _f(300.0, "A collective between the ranks of a --tp replica (one rank dead or "
                                     "stopped) fails after this many seconds; the replica's ranks are restarted "
                                     "and the batch retried.", group="faults", ge=1, le=MAX_TIMEOUT_S)
    batch_timeout_s: float = _f(1800.0, "A batch still running after this many seconds (a stopped or hung "
                                "actor) has its actor killed; Ray restarts it and the batch is retried like a "
                                "crash.", group="faults", ge=1, le=MAX_TIMEOUT_S)

    # the fields that change what a row's output is (recorded per run, checked on resume)
    RESULT_FIELDS: ClassVar[tuple[str, ...]] = ("model", "tokenizer", "dtype", "text_column", "id_column",
                                                "keep_columns", "max_model_len", "head_precision", "messages_column",
                                                "thinking")

    def __init__(self, **values: Any):
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise UsageError(explain(exc, type(self))) from None

    @field_validator("keep_columns", mode="before")
    @classmethod
    def _split_columns(cls, value):
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, list):
            value = tuple(c.strip() for c in value if isinstance(c, str) and c.strip()) \
                if all(isinstance(c, str) for c in value) else tuple(value)
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _ints_are_floats(cls, value, info):
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, int) and not isinstance(value, bool) and annotation in (float, Optional[float]):
            return float(value)
        return value

    @model_validator(mode="after")
    def _check_together(self):
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in OUTPUT, --overwrite replaces it: give one of them")
        if set(self.row_columns()) & set(self.tokenizer_columns()) or self.id_column in self.row_columns():
            raise ValueError(f"the columns {self.row_columns()} must differ from the text and id columns")
        if self.id_column in self.keep_columns:
            raise ValueError(f"keep_columns: the id column {self.id_column!r} is always written (as 'id'); do "
                             "not list it")
        clash = set(self.keep_columns) & set(self.output_columns(every=True))
        if clash:
            raise ValueError(f"keep_columns {sorted(clash)} clash with output columns; rename them in the input")
        return self

    def output_columns(self, every: bool = False) -> list[str]:
        """The job's output columns (kept columns not included); `every`: all it can write."""
        raise NotImplementedError

    def text_columns(self) -> tuple[str, ...]:
        """The input columns of text (strings) the tokenizer reads."""
        return () if self.messages_column else (self.text_column,)

    def tokenizer_columns(self) -> tuple[str, ...]:
        """Every input column the tokenizer reads: the text columns or the conversations."""
        return (self.messages_column,) if self.messages_column else self.text_columns()

    def row_columns(self) -> tuple[str, ...]:
        """Other input columns the model's step reads per row (carried past the tokenizer)."""
        return ()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "JobConfig":
        """Build from a mapping; unknown keys are refused with a suggestion."""
        return cls(**d)

    def replace(self, **changes: Any) -> "JobConfig":
        return type(self)(**{**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        d = self.model_dump(exclude={"task"})
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

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

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `dsv4batch.model.EngineConfig`."""
        kw = dict(max_num_batched_tokens=self.max_batched_tokens, max_model_len=self.max_model_len,
                  planner=self.planner, sort_by_length=self.sort_by_length, head_precision=self.head_precision,
                  attn_backend=self.attn_backend)
        if self.prefill_chunk_size is not None:
            kw["prefill_chunk_size"] = self.prefill_chunk_size
        return kw

    def result_fields(self) -> dict[str, Any]:
        """The fields that change what a row's output is (recorded per run, checked on resume)."""
        d = {**self.to_dict(), "task": self.task}
        return {k: d[k] for k in ("task", *self.RESULT_FIELDS)}


def explain(exc: ValidationError, cls) -> str:
    """One line per pydantic error, naming the field: 'config field 'x': must be >= 1, got 0'."""
    lines = []
    for err in exc.errors(include_url=False):
        field = ".".join(str(p) for p in err["loc"]) or None
        value, kind, ctx = err.get("input"), err["type"], err.get("ctx") or {}
        if kind == "extra_forbidden":
            hint = difflib.get_close_matches(field, list(cls.model_fields), n=1)
            lines.append(f"unknown config field {field!r}" + (f" (did you mean {hint[0]!r}?)" if hint else ""))
            continue
        if kind == "literal_error":
            text = f"{value!r} is not one of {ctx.get('expected')}"
        elif kind in ("greater_than_equal", "greater_than", "less_than_equal"):
            op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<="}[kind]
            limit = ctx.get("ge", ctx.get("gt", ctx.get("le")))
            text = f"must be {op} {limit}, got {value!r}"
        elif kind == "finite_number":
            text = f"must be a finite number, got {value!r}"
        elif kind.endswith("_type") or kind.endswith("_parsing"):
            text = f"expected {kind.removesuffix('_type').removesuffix('_parsing')}, got {value!r}"
        else:
            text = err["msg"].removeprefix("Value error, ")
        lines.append(text if field is None else f"config field {field!r}: {text}")
    return "; ".join(lines)


def resolved_dtype(name: str, device: str) -> str:
    """`--dtype` on `device`: auto = bfloat16 on CUDA, float32 on the CPU backend."""
    if name == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    return name
