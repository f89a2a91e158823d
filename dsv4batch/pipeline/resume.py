"""`--resume`: the configuration recorded in OUTPUT's `_job.json` must still hold.

A resumed run must produce rows the first run could have produced: the fields of
`ScoreConfig.result_fields` (model, dtype, columns, scoring options) must equal the recorded
ones, and a difference is refused by name. The finished part files are listed by
`output.finished_parts`; their ids are only ever read by the Ray Data id scan (`ids.scan`).
"""

from __future__ import annotations

from dsv4batch.pipeline import output as O
from dsv4batch.pipeline.config import ScoreConfig
from dsv4batch.pipeline.errors import UsageError


def check_config(output: str, config: ScoreConfig, log=None) -> dict:
    """The recorded `_job.json`; refuses a configuration whose results would differ."""
    try:
        job = O.read_json(output, O.JOB)
        recorded = job["result"]
    except Exception as exc:
        raise UsageError(f"--resume: cannot read {O.JOB} in {output!r}: {exc}") from exc
    current = config.result_fields()
    diffs = [f"{k} {recorded.get(k)!r} -> {v!r}" for k, v in current.items()
             if recorded.get(k) != v]
    if diffs:
        raise UsageError("--resume: the configuration differs from the run in OUTPUT "
                         f"({O.JOB}) in: {'; '.join(diffs)}. Resume with the recorded settings, "
                         "or score into a new OUTPUT")
    if log and job.get("input") != config.input:
        log(f"[dsv4batch] note: INPUT {config.input!r} differs from the recorded "
            f"{job.get('input')!r}; rows are matched by id")
    return job
