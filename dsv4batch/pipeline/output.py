"""OUTPUT folder handling: refuse to mix runs, check writability early, write files atomically.

Layout: `part-<run>-<task>.parquet` (scores), `_job.json` (configuration, written first),
`_metrics.json` and `_SUCCESS` (written last, only when every input row is accounted for).
`--resume` keeps the part files and `_job.json` of the run in OUTPUT and removes what a killed
run may have left (temporary files) and its `_SUCCESS`, so the folder reads "in progress".
"""

from __future__ import annotations

import fnmatch
import json
import uuid

from dsv4batch.pipeline.config import UsageError
from dsv4batch.pipeline.sink import PART_PREFIX, TMP_PREFIX, open_fs

JOB, METRICS, SUCCESS = "_job.json", "_metrics.json", "_SUCCESS"
OURS = (f"{PART_PREFIX}*.parquet", f"{TMP_PREFIX}*", JOB, METRICS, SUCCESS)


def _entries(fs, root: str) -> list[str]:
    import pyarrow.fs as pafs

    return [i.base_name for i in fs.get_file_info(pafs.FileSelector(root))]


def prepare_output(path: str, overwrite: bool, resume: bool = False) -> bool:
    """Create OUTPUT, clear a previous run (overwrite) or keep it (resume); probe writability.

    Returns True when OUTPUT holds a run to resume.
    """
    import pyarrow.fs as pafs

    fs, root = open_fs(path)
    kind = fs.get_file_info(root).type
    if kind == pafs.FileType.File:
        raise UsageError(f"OUTPUT {path!r} is a file; it must be a folder")
    resuming = False
    if kind == pafs.FileType.Directory:
        names = _entries(fs, root)
        if names and not (overwrite or resume):
            raise UsageError(f"OUTPUT {path!r} is not empty; pass --resume to continue the run "
                             "in it or --overwrite to replace it")
        foreign = [n for n in names if not any(fnmatch.fnmatch(n, p) for p in OURS)]
        if foreign:
            raise UsageError(f"OUTPUT {path!r} holds files dsv4batch did not write "
                             f"({sorted(foreign)[:5]}); refusing to "
                             f"{'resume in' if resume else 'overwrite'} it")
        if resume and names and JOB not in names:
            raise UsageError(f"OUTPUT {path!r} has no {JOB}: there is no run to resume")
        resuming = bool(resume and names)
        for n in names:
            if not resuming or fnmatch.fnmatch(n, f"{TMP_PREFIX}*") or n == SUCCESS:
                fs.delete_file(f"{root}/{n}")
    probe = f"{root}/{TMP_PREFIX}probe-{uuid.uuid4().hex}"
    try:
        fs.create_dir(root, recursive=True)
        with fs.open_output_stream(probe) as f:
            f.write(b"ok")
        fs.delete_file(probe)
    except Exception as exc:
        raise UsageError(f"OUTPUT {path!r} is not writable: {exc}") from exc
    return resuming


def write_table(path: str, name: str, table) -> None:
    """Write OUTPUT/name as Parquet through a temporary name and a rename."""
    import pyarrow.parquet as pq

    fs, root = open_fs(path)
    tmp = f"{root}/{TMP_PREFIX}{uuid.uuid4().hex}.{name}.inprogress"
    with fs.open_output_stream(tmp) as f:
        pq.write_table(table, f)
    fs.move(tmp, f"{root}/{name}")


def write_json(path: str, name: str, obj) -> None:
    """Write OUTPUT/name through a temporary name and a rename."""
    fs, root = open_fs(path)
    tmp = f"{root}/{TMP_PREFIX}{uuid.uuid4().hex}.{name}"
    with fs.open_output_stream(tmp) as f:
        f.write((json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())
    fs.move(tmp, f"{root}/{name}")


def read_json(path: str, name: str):
    fs, root = open_fs(path)
    with fs.open_input_stream(f"{root}/{name}") as f:
        return json.loads(f.read())
