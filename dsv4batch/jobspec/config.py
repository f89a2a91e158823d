"""The job configurations: one validated object from the CLI down to every pipeline stage.

`JobConfig` holds what every job shares (INPUT and OUTPUT, the model, the engine, resources,
faults); `ScoreConfig` adds what scoring reads and writes, `GenerateConfig` generation's
sampling defaults and cache. They are pydantic models, as ray.data.llm's configs are: every
field typed and documented (`description`; `--help` is generated from it, grouped by
`json_schema_extra["group"]`; fields marked `cli: False` are Python-only: benchmark and debug
knobs), unknown fields refused with a suggestion, every value checked on construction (a bad one
raises `UsageError` naming the field); frozen and picklable, so Ray ships one object to every
task and actor.

This module holds the jobs' own configurations and the CLI's view of them; what they share is
`config_base` (`JobConfig`, the field helpers), re-exported here.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from pydantic import field_validator, model_validator

from dsv4batch.jobspec.config_base import (GROUPS, MAX_GPU_MEMORY_GIB, MAX_MIB, JobConfig, _f, explain,
                                           resolved_dtype)
from dsv4batch.jobspec.schema import (OPENAI_ID, OPENAI_LINE, OPENAI_REQUEST, OPENAI_SAMPLING, generate_output_names,
                                      output_names)

__all__ = ["GROUPS", "JOBS", "MAX_GPU_MEMORY_GIB", "GenerateConfig", "JobConfig", "ScoreConfig", "cli_fields",
           "explain", "resolved_dtype"]

TRUNCATE = ("none", "left", "right")


class ScoreConfig(JobConfig):
    """`dsv4batch score`: the log-probabilities of each row's tokens."""

    task: Literal["score"] = "score"
    target_column: Optional[str] = _f(None, "Optional column with a continuation: only its tokens are scored, "
                                      "conditioned on the prompt (log-likelihood).")
    token_logprobs: bool = _f(False, "Also write token_logprobs (list<float32>) per row.")
    top_logprobs: int = _f(0, "Also write the K most likely tokens at every scored position: top_ids "
                           "(list<list<int32>>) and top_logprobs (list<list<float32>>, descending). 0: not "
                           "written.", ge=0)
    truncate: Literal[TRUNCATE] = _f("none", "Rows longer than max_model_len tokens: 'none' answers them with an "
                                     "error, 'left' drops their first tokens (bos stays), 'right' their last; "
                                     "column truncated_tokens counts what was dropped.")

    RESULT_FIELDS: ClassVar[tuple[str, ...]] = (*JobConfig.RESULT_FIELDS, "target_column", "token_logprobs", "top_logprobs", "truncate")

    @model_validator(mode="after")
    def _check_target(self):
        if self.target_column is not None and self.target_column == self.text_column:
            raise ValueError("target_column must differ from text_column")
        if self.input_format == "openai-batch":
            raise ValueError("an openai-batch input holds generation requests: use dsv4batch generate")
        if self.target_column is not None and self.messages_column is not None:
            raise ValueError("with messages_column the scored target is the conversation's last assistant "
                             "message: do not give target_column")
        return self

    def text_columns(self) -> tuple[str, ...]:
        if self.messages_column:
            return ()
        return (self.text_column, *([self.target_column] if self.target_column else []))

    def output_columns(self, every: bool = False) -> list[str]:
        if every:
            return output_names(True, True, 1)
        return output_names(self.token_logprobs, self.truncate != "none", self.top_logprobs)


class GenerateConfig(JobConfig):
    """`dsv4batch generate`: a continuation of each row's prompt (continuous batching)."""

    task: Literal["generate"] = "generate"
    sampling_params_column: Optional[str] = _f(None, "Column with per-row sampling parameters (a struct or a "
                                               "JSON object with fields of the options below, e.g. "
                                               "{\"temperature\": 0.7, \"max_tokens\": 64}); a row's null fields "
                                               "take the options' values.")
    max_tokens: int = _f(256, "Most tokens to generate per row.", group="generation", ge=1)
    temperature: float = _f(0.0, "0: greedy (ties to the lowest token id); > 0: sample from softmax(logits / "
                            "temperature).", group="generation", ge=0)
    top_p: float = _f(1.0, "Sample among the most likely tokens whose mass reaches top_p, in (0, 1].",
                      group="generation", gt=0, le=1)
    top_k: int = _f(0, "Sample among the k most likely tokens; 0 or -1: all.", group="generation", ge=-1)
    min_p: float = _f(0.0, "Sample among tokens with probability >= min_p x the largest, in [0, 1].",
                      group="generation", ge=0, le=1)
    seed: int = _f(0, "Run seed: a row without its own seed samples with a seed derived from this and its id, "
                   "so its output never depends on its batch, replica or a resume.", group="generation", ge=0)
    stop: tuple[str, ...] = _f((), "Strings that end a row's generation; the text is cut before the first one "
                               "(comma-separated on the CLI; use --sampling-params-column for strings with "
                               "commas).", group="generation")
    stop_token_ids: tuple[int, ...] = _f((), "Token ids that end a row's generation (comma-separated).",
                                         group="generation")
    ignore_eos: bool = _f(False, "Go on past the end-of-sentence token (until max_tokens or a stop).",
                          group="generation")
    logprobs: bool = _f(False, "Also write generated_logprobs (list<float32>): each generated token's logprob "
                        "under the model.")
    top_logprobs: int = _f(0, "Also write top_ids / top_logprobs: the K most likely tokens at every generated "
                           "position. 0: not written.", ge=0)
    max_num_seqs: int = _f(64, "Requests generating at once per replica (continuous batching).",
                           group="engine", ge=1)
    max_cache_mib: Optional[float] = _f(None, "The cache pool's budget per replica in MiB (every running "
                                        "request's window, compressed entries and indexer keys); requests wait "
                                        "while it is full. None: what max_num_seqs requests of max_model_len "
                                        "need, within a quarter of the host's memory (CPU) or what the GPU has "
                                        "left (`dsv4batch plan`).", group="engine", gt=0, le=MAX_MIB)
    batch_size: int = _f(256, "Rows per Ray Data batch sent to an actor (its requests are batched "
                         "continuously within it).", group="resources", ge=1)
    output_format: Literal["parquet", "openai-batch"] = _f(
        "parquet", "openai-batch (with --input-format openai-batch): also write OUTPUT/output.jsonl, one OpenAI "
        "batch response line per request line (`chat.completion` / `text_completion` bodies, status 400 for a bad "
        "request), in input order, when the run is complete.", group="run")

    RESULT_FIELDS: ClassVar[tuple[str, ...]] = (
        *JobConfig.RESULT_FIELDS, "sampling_params_column", "max_tokens", "temperature", "top_p", "top_k", "min_p",
        "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "input_format", "output_format")

    @field_validator("stop", "stop_token_ids", mode="before")
    @classmethod
    def _split_list(cls, value, info):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
            if info.field_name == "stop_token_ids":
                try:
                    value = [int(v) for v in value]
                except ValueError:
                    raise ValueError("stop_token_ids must be comma-separated integers") from None
        return tuple(value) if isinstance(value, list) else value

    @model_validator(mode="before")
    @classmethod
    def _openai_columns(cls, values):
        if isinstance(values, dict) and values.get("input_format") == "openai-batch":
            values = {**values, "id_column": values.get("id_column", OPENAI_ID),
                      "text_column": values.get("text_column", OPENAI_REQUEST)}
        return values

    @model_validator(mode="after")
    def _check_sampling(self):
        self.sampling_defaults()  # the model's own checks (e.g. an empty stop string)
        if self.is_openai and (self.id_column, self.text_column) != (OPENAI_ID, OPENAI_REQUEST):
            raise ValueError("an openai-batch input's rows are its request lines: id_column and text_column "
                             "are set by it")
        if self.is_openai and (self.messages_column or self.sampling_params_column):
            raise ValueError("an openai-batch input carries each request's messages and sampling parameters: "
                             "do not give messages_column or sampling_params_column")
        if self.output_format == "openai-batch" and not self.is_openai:
            raise ValueError("output_format openai-batch answers request lines: it needs input_format "
                             "openai-batch")
        return self

    @property
    def is_openai(self) -> bool:
        """INPUT is an OpenAI batch file (`pipeline.openai_batch`): its rows are request lines."""
        return self.input_format == "openai-batch"

    def params_column(self) -> str | None:
        """The column of per-row sampling parameters the generation step reads (JSON objects)."""
        return OPENAI_SAMPLING if self.is_openai else self.sampling_params_column

    def sampling_defaults(self):
        """The options as the model's `SamplingParams` (every row's defaults)."""
        from dsv4batch.model.sampling import SamplingParams

        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, top_logprobs=self.top_logprobs)

    def engine_kwargs(self) -> dict[str, Any]:
        kw = super().engine_kwargs()
        return {**kw, "max_num_seqs": self.max_num_seqs, "max_cache_mib": self.max_cache_mib}

    def row_columns(self) -> tuple[str, ...]:
        if self.is_openai:
            return (OPENAI_LINE,)
        return (self.sampling_params_column,) if self.sampling_params_column else ()

    def output_columns(self, every: bool = False) -> list[str]:
        if every:
            return generate_output_names(True, 1, True)
        return generate_output_names(self.logprobs, self.top_logprobs, self.is_openai)


JOBS = {"score": ScoreConfig, "generate": GenerateConfig}


def cli_fields(cls) -> dict:
    """{name: FieldInfo} of the fields `dsv4batch <job>` has an option for, in order."""
    return {name: f for name, f in cls.model_fields.items()
            if name != "task" and (f.json_schema_extra or {}).get("cli", True)}
