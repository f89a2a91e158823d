"""The pipeline's statistics records (extending the engine's `StepStats`); summed with `+`.

`BatchStats`: what a replica actor did for one batch (rows, tokens, its engine's `StepStats`,
times); the collector adds them per actor. `Written`: what the sink wrote, counted from the
written tables, so a retried batch is never counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv4batch.jobspec.schema import ERROR
from dsv4batch.model.stats import Stats, StepStats, first, peak


@dataclass
class BatchStats(StepStats):
    batches: int = 0
    rows: int = 0  # rows answered (scored or with an error)
    rows_scored: int = 0
    rows_errored: int = 0  # rows with an error (input problems included)
    rows_failed: int = 0  # rows whose scoring failed (counted against max_errored_rows)
    input_tokens: int = 0  # tokens of the scored rows (bos included)
    scored_tokens: int = 0
    ttft_s: list = field(default_factory=list)  # generation: per row, seconds to its first token
    busy_s: float = 0.0  # time in the actor's __call__
    t_first: float | None = first()  # wall clock of the first batch's start
    t_last: float | None = peak(None)  # wall clock of the last batch's end


@dataclass
class Written(Stats):
    rows: int = 0
    rows_errored: int = 0
    input_tokens: int = 0
    scored_tokens: int = 0
    generated_tokens: int = 0
    files: list = field(default_factory=list)  # part file names

    @classmethod
    def of_table(cls, table) -> "Written":
        """Counts of one output table (`schema.output_schema` or `schema.generate_schema`)."""
        import pyarrow.compute as pc

        def total(col: str) -> int:
            return int(pc.sum(table[col]).as_py() or 0) if col in table.column_names else 0

        return cls(table.num_rows, table.num_rows - table[ERROR].null_count,
                   total("num_tokens") + total("num_prompt_tokens"), total("num_scored_tokens"),
                   total("num_generated_tokens"))
