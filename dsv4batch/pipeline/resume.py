"""`--resume`: the run recorded in OUTPUT (its `_job.json` and finished part files).

A resumed run must produce rows the first run could have produced: the fields of
`ScoreConfig.result_fields` (model, dtype, columns, scoring options) must equal the recorded
ones, and a difference is refused by name. Part files are complete by construction (written
under a temporary name, then renamed), so every id in them is done; their row counts come from
the Parquet footers, the ids themselves are only ever read by the Ray Data id scan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4batch.pipeline import output as O
from dsv4batch.pipeline.config import ScoreConfig, UsageError
from dsv4batch.pipeline.sink import PART_PREFIX, open_fs


@dataclass
class Parts:
    files: list[str]  # finished part files (paths inside the OUTPUT filesystem)
    rows: int
    id_type: Any  # pyarrow type of their id column (None when there are none)


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


def finished_parts(output: str) -> Parts:
    """Part files in OUTPUT with their total row count and id type, from the footers."""
    import pyarrow.fs as pafs

    from dsv4batch.pipeline.read import read_footers

    fs, root = open_fs(output)
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        return Parts([], 0, None)
    files = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(root))
                   if i.base_name.startswith(PART_PREFIX) and i.base_name.endswith(".parquet"))
    footers = read_footers(fs, files, "part file {!r} in OUTPUT")
    for f, (_, schema) in zip(files, footers):
        if "id" not in schema.names:
            raise UsageError(f"cannot read part file {f!r} in OUTPUT: it has no 'id' column")
    return Parts(files, sum(n for n, _ in footers),
                 footers[0][1].field("id").type if footers else None)
