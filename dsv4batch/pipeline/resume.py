"""`--resume`: what `_job.json` recorded must still hold, or the run is refused by name.

A resumed run must produce rows the first run could have produced:
- `check_config`: the fields of `ScoreConfig.result_fields` (model, dtype, columns, scoring
  options) equal the recorded ones;
- `check_tokenizer`: the same tokenizer file (its sha256), whichever path names it;
- `check_compute`: the same device kind and resolved compute dtype (`--allow-device-change`
  accepts another, with a warning: the dataset then mixes precisions);
- `check_inputs`: INPUT's files match their recorded fingerprints (size, rows, Parquet footer
  digest). With derived ids (`<file>:<row>`) a changed file is refused, naming it (its rows
  would carry other rows' scores); with explicit ids it is a warning (rows are matched by id).
  Added or removed files are reported.
The finished part files are listed by `output.finished_parts`; their ids are only ever read by
the Ray Data id scan (`ids.scan`).
"""

from __future__ import annotations

from dsv4batch.jobspec.config import JobConfig
from dsv4batch.jobspec.errors import UsageError
from dsv4batch.pipeline import output as O


def check_config(job: dict, config: JobConfig, log=None) -> dict:
    """Refuse a configuration whose results would differ from the recorded `job`'s."""
    # a field the recorded run predates had its default's meaning then (e.g. top_logprobs 0)
    defaults = {name: f.default for name, f in type(config).model_fields.items()}
    recorded = {k: job["result"].get(k, defaults[k]) for k in config.result_fields()}
    diffs = [f"{k} {recorded[k]!r} -> {v!r}" for k, v in config.result_fields().items()
             if recorded[k] != v]
    if diffs:
        raise UsageError("--resume: the configuration differs from the run in OUTPUT "
                         f"({O.JOB}) in: {'; '.join(diffs)}. Resume with the recorded settings, "
                         "or score into a new OUTPUT")
    if log and job.get("input") != config.input:
        log(f"[dsv4batch] note: INPUT {config.input!r} differs from the recorded "
            f"{job.get('input')!r}; rows are matched by id")
    return job


def check_tokenizer(job: dict, tokenizer: dict) -> None:
    """`tokenizer`: this run's record (`model.tokenizer.check_tokenizer`); the recorded file's
    sha256 must match (the same --tokenizer, or the model's tokenizer.json, rewritten in between
    would tokenize the rest of the rows differently)."""
    recorded = job.get("tokenizer")
    if not recorded or recorded.get("sha256") == tokenizer["sha256"]:
        return  # an OUTPUT of an older version records none
    raise UsageError(f"--resume: the tokenizer {tokenizer['path']} differs from the one OUTPUT was written "
                     f"with ({recorded.get('path')}, sha256 {recorded.get('sha256', '')[:12]}...): the rows "
                     "left would be tokenized differently. Resume with that tokenizer, or write a new OUTPUT")


def check_compute(job: dict, compute: dict, allow_change: bool, log) -> None:
    """`compute`: this run's {"device", "dtype"}; the recorded one must match."""
    recorded = job.get("compute")
    if not recorded or recorded == compute:
        return
    what = (f"OUTPUT was scored on {recorded.get('device')} in {recorded.get('dtype')}, this run "
            f"would score on {compute['device']} in {compute['dtype']}")
    if not allow_change:
        raise UsageError(f"--resume: {what}; the dataset would mix precisions. Resume on the "
                         "same device kind, pass --dtype to match, or --allow-device-change")
    log(f"[dsv4batch] warning: {what} (--allow-device-change)")


def check_inputs(job: dict, fingerprints: list[dict] | None, derived_ids: bool, log) -> None:
    """Compare INPUT's files with the fingerprints recorded in `job` (see module doc)."""
    before = {f["path"]: f for f in job.get("inputs") or []}
    if not before or fingerprints is None:
        return  # an OUTPUT of an older version, or more files than footers are read
    now = {f["path"]: f for f in fingerprints}
    changed = sorted(p for p in now.keys() & before.keys() if now[p] != before[p])
    added, removed = sorted(now.keys() - before.keys()), sorted(before.keys() - now.keys())
    if changed and derived_ids:
        raise UsageError(f"--resume: INPUT file(s) changed since the first run ({changed[:5]}): "
                         "their derived ids '<file>:<row>' would now name other rows. Score "
                         "into a new OUTPUT, or give the input an id column")
    if changed:
        log(f"[dsv4batch] warning: INPUT file(s) changed since the first run ({changed[:5]}); "
            "rows are matched by their ids")
    if added or removed:
        log(f"[dsv4batch] note: INPUT's files changed since the first run: {len(added)} added "
            f"{added[:3]}, {len(removed)} removed {removed[:3]}")
