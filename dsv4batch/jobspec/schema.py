"""Column contract between the pipeline steps.

read -> [derive ids] -> Tokenize -> ScoringActor -> sink (`stages/`, `actors/`, `ids/`, `sink`).
Each step declares a `StageSpec`: the columns it needs and the ones it adds; `check_columns`
turns a missing column into a message that lists what is available. pyarrow is imported lazily
(only `output_schema` needs it).

Text: the one invalid-text rule of every input format (`utf8_text`, `utf8_values`). The columns
the tokenizer reads (text, target, conversations) are UTF-8 text in any of Arrow's string,
binary or dictionary-of-those types; every invalid byte sequence is decoded as U+FFFD (Python's
"replace"), never an error, and every character is kept, NUL (U+0000) included. Other columns
(ids, --keep-columns) are carried as read.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4batch.jobspec.errors import UsageError

ID = "id"
ERROR = "error"
# internal columns from Tokenize to the scoring actor (never written)
INPUT_IDS = "__input_ids"  # list<int32>: [bos] + tokens(prompt) [+ tokens(target)]
NUM_SCORED = "__num_scored"  # int32: how many trailing tokens of INPUT_IDS are scored
NUM_TRUNCATED = "__num_truncated"  # int32: tokens --truncate dropped from the row
INTERNAL = (INPUT_IDS, NUM_SCORED, NUM_TRUNCATED)

# output columns, in order (token_logprobs only with config.token_logprobs)
SCORE_COLUMNS = ("num_tokens", "num_scored_tokens", "logprob_sum", "logprob_mean", "perplexity",
                 "is_greedy")  # is_greedy: every scored token was the argmax (null: an error)
TOKEN_LOGPROBS = "token_logprobs"
TOP_IDS, TOP_LOGPROBS = "top_ids", "top_logprobs"  # only with --top-logprobs K > 0
TRUNCATED = "truncated_tokens"  # only with --truncate left|right


def is_text_type(t) -> bool:
    """A type `utf8_text` reads as text: string, large_string, string_view, binary, large_binary,
    or a dictionary of one of them (what pandas categoricals write to Parquet)."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    return any(f(t) for f in (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view,
                              pa.types.is_binary, pa.types.is_large_binary))


def utf8_text(column):
    """A text column (`is_text_type`; Array or ChunkedArray) as valid UTF-8 strings (the module's
    rule: invalid bytes -> U+FFFD, nulls stay null): large_string for the large types, else
    string. Valid columns pass through untouched (strings) or cast (binary, dictionaries); only a
    column holding invalid UTF-8 is decoded in Python."""
    import pyarrow as pa

    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    t = column.type
    target = pa.large_string() if pa.types.is_large_binary(t) or pa.types.is_large_string(t) else pa.string()
    try:
        if pa.types.is_binary(t) or pa.types.is_large_binary(t):
            return column.cast(target)  # the cast checks the UTF-8
        column.validate(full=True)  # strings: a full validation checks the UTF-8
        return column
    except pa.ArrowInvalid:
        values = column.cast(pa.large_binary()).to_pylist()
        return pa.array([None if v is None else v.decode("utf-8", "replace") for v in values], target)


def utf8_columns(table, columns, strings_only: bool = False):
    """`table` with its `columns` (those it has) read by `utf8_text`'s rule; `strings_only`: only
    the string and large_string ones (a kept binary column stays bytes)."""
    import pyarrow as pa

    for c in columns:
        i = table.schema.get_field_index(c) if c else -1
        kind = table.schema.field(i).type if i >= 0 else None
        if kind is not None and (not strings_only or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            table = table.set_column(i, c, utf8_text(table.column(i)))
    return table


def utf8_values(column) -> list:
    """Python values of any column, text leaves decoded by the module's rule (a conversation's
    list<struct<role, content>> included): `to_pylist`, except that invalid UTF-8 in a string
    leaf becomes U+FFFD instead of a `UnicodeDecodeError`."""
    if is_text_type(column.type):
        return utf8_text(column).to_pylist()
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        return [_decoded(v) for v in column.cast(_as_binary(column.type)).to_pylist()]


def _as_binary(t):
    """`t` with every string leaf (nested in lists and structs) as large_binary."""
    import pyarrow as pa

    if is_text_type(t):
        return pa.large_binary()
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _as_binary(f.type), f.nullable) for f in t])
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        inner = pa.field(t.value_field.name, _as_binary(t.value_type))
        return pa.list_(inner) if pa.types.is_list(t) else pa.large_list(inner)
    return t


def _decoded(value):
    """A Python value with its bytes decoded by the module's rule, through lists and dicts."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, list):
        return [_decoded(v) for v in value]
    if isinstance(value, dict):
        return {k: _decoded(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class StageSpec:
    """What a pipeline step reads from its input batch and what it adds to its output."""

    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]


def output_names(token_logprobs: bool, truncated: bool = False, top_logprobs: int = 0) -> list[str]:
    return [ID, *SCORE_COLUMNS, *([TOKEN_LOGPROBS] if token_logprobs else []),
            *([TOP_IDS, TOP_LOGPROBS] if top_logprobs else []),
            *([TRUNCATED] if truncated else []), ERROR]


# generation's output columns (generate_output_names), after id
GENERATE_COLUMNS = ("num_prompt_tokens", "generated_text", "generated_token_ids", "num_generated_tokens",
                    "finish_reason", "stop_reason")
GENERATED_LOGPROBS = "generated_logprobs"  # only with --logprobs


# an openai-batch input's rows (`pipeline.openai_batch`): the request line's custom_id (the row id), line
# number and text; what the tokenizer step adds (sampling parameters, what the response needs);
# the generation step's status code
OPENAI_ID, OPENAI_LINE, OPENAI_REQUEST = "custom_id", "line", "request"
OPENAI_SAMPLING, OPENAI_META, OPENAI_STATUS = "openai_sampling", "openai_meta", "openai_status"
OPENAI_COLUMNS = (OPENAI_LINE, OPENAI_META, OPENAI_STATUS)


def generate_output_names(logprobs: bool, top_logprobs: int = 0, openai: bool = False) -> list[str]:
    return [ID, *GENERATE_COLUMNS, *([GENERATED_LOGPROBS] if logprobs else []),
            *([TOP_IDS, TOP_LOGPROBS] if top_logprobs else []), *(OPENAI_COLUMNS if openai else ()), ERROR]


def config_output_names(config) -> list[str]:
    """A job config's output columns, kept columns included: every part file's columns."""
    return [*config.output_columns(), *config.keep_columns]


def output_schema(id_type, token_logprobs: bool, keep_fields=(), truncated: bool = False,
                  top_logprobs: int = 0):
    """The schema of every written part file: `id` keeps the input's id type. With
    `top_logprobs` K > 0, per row [scored positions][K] token ids and their logprobs."""
    import pyarrow as pa

    fields = [pa.field(ID, id_type), pa.field("num_tokens", pa.int32()),
              pa.field("num_scored_tokens", pa.int32()), pa.field("logprob_sum", pa.float64()),
              pa.field("logprob_mean", pa.float64()), pa.field("perplexity", pa.float64()),
              pa.field("is_greedy", pa.bool_())]
    if token_logprobs:
        fields.append(pa.field(TOKEN_LOGPROBS, pa.list_(pa.float32())))
    if top_logprobs:
        fields += [pa.field(TOP_IDS, pa.list_(pa.list_(pa.int32()))),
                   pa.field(TOP_LOGPROBS, pa.list_(pa.list_(pa.float32())))]
    if truncated:
        fields.append(pa.field(TRUNCATED, pa.int32()))
    fields.append(pa.field(ERROR, pa.string()))
    return pa.schema(fields + list(keep_fields))


def generate_schema(id_type, logprobs: bool, keep_fields=(), top_logprobs: int = 0, openai: bool = False):
    """The schema of every part file of `dsv4batch generate` (`id` keeps the input's id type).
    stop_reason: the stop string, or the stop token id in decimal, that ended the row."""
    import pyarrow as pa

    fields = [pa.field(ID, id_type), pa.field("num_prompt_tokens", pa.int32()),
              pa.field("generated_text", pa.string()), pa.field("generated_token_ids", pa.list_(pa.int32())),
              pa.field("num_generated_tokens", pa.int32()), pa.field("finish_reason", pa.string()),
              pa.field("stop_reason", pa.string())]
    if logprobs:
        fields.append(pa.field(GENERATED_LOGPROBS, pa.list_(pa.float32())))
    if top_logprobs:
        fields += [pa.field(TOP_IDS, pa.list_(pa.list_(pa.int32()))),
                   pa.field(TOP_LOGPROBS, pa.list_(pa.list_(pa.float32())))]
    if openai:  # the request line, what its response needs, its status code
        fields += [pa.field(OPENAI_LINE, pa.int64()), pa.field(OPENAI_META, pa.string()),
                   pa.field(OPENAI_STATUS, pa.int16())]
    fields.append(pa.field(ERROR, pa.string()))
    return pa.schema(fields + list(keep_fields))


def config_schema(config, id_type, keep_fields=()):
    """The part-file schema of a job config (`output_schema` or `generate_schema`)."""
    if config.task == "generate":
        return generate_schema(id_type, config.logprobs, keep_fields, config.top_logprobs, config.is_openai)
    return output_schema(id_type, config.token_logprobs, keep_fields, config.truncate != "none",
                         config.top_logprobs)


def id_kind(t) -> str:
    """'integer', 'string' or 'binary': ids of one kind compare after a cast (int32 vs int64)."""
    import pyarrow as pa

    if pa.types.is_integer(t):
        return "integer"
    return "binary" if pa.types.is_binary(t) or pa.types.is_large_binary(t) else "string"


def input_columns(config, available: list[str] | None = None) -> list[str]:
    """Columns to read: text, target, id (when present or `available` is unknown), keep."""
    cols = [*config.tokenizer_columns(), *config.row_columns()]
    if available is None or config.id_column in available:
        cols.append(config.id_column)
    cols.extend(c for c in config.keep_columns if c not in cols)
    return cols


def check_columns(stage: str, needed, available, source: str = "input") -> None:
    """Raise `UsageError` naming the missing columns and listing the available ones."""
    missing = [c for c in needed if c not in available]
    if missing:
        raise UsageError(f"{stage}: column(s) {missing} not in the {source}; available columns: "
                         f"{sorted(available)}")
