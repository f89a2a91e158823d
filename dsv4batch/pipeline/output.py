"""The OUTPUT folder's layout, all of it: names, what is ours, one temp-then-rename writer.

    part-<run>-<task>.parquet   scores (`part_name`), each written under a temporary name
    _tmp-<uuid>.<name>...       a file being written (`staged`); readers skip it
    _job.json                   the run's configuration, written first (`JOB`)
    _metrics.json, _SUCCESS     written last, only when every input row is accounted for

Every file is written through `staged`: under a `_tmp-` name, renamed to its final name when
complete, so a file either exists whole under its final name or not at all. A part file's name
depends only on the run id and the write task index: a retried task replaces its own file.
`--resume` keeps the part files and `_job.json` and removes what a killed run may have left
(temporary files) and its `_SUCCESS`, so the folder reads "in progress".
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import uuid
from dataclasses import dataclass
from typing import Any

from dsv4batch.pipeline.errors import UsageError
from dsv4batch.pipeline.fs import open_fs, read_footers

JOB, METRICS, SUCCESS = "_job.json", "_metrics.json", "_SUCCESS"
PART_PREFIX, PART_SUFFIX, TMP_PREFIX = "part-", ".parquet", "_tmp-"
OURS = (f"{PART_PREFIX}*{PART_SUFFIX}", f"{TMP_PREFIX}*", JOB, METRICS, SUCCESS)


def part_name(run_id: str, task: int) -> str:
    return f"{PART_PREFIX}{run_id}-{task:06d}{PART_SUFFIX}"


def is_part(name: str) -> bool:
    return name.startswith(PART_PREFIX) and name.endswith(PART_SUFFIX)


@contextlib.contextmanager
def staged(fs, root: str, name: str):
    """A writable stream for `root/name`: written under a temporary name, renamed to `name`
    when the block exits normally, deleted when it raises."""
    tmp = f"{root}/{TMP_PREFIX}{uuid.uuid4().hex}.{name}.inprogress"
    stream = fs.open_output_stream(tmp)
    try:
        yield stream
        stream.close()
        fs.move(tmp, f"{root}/{name}")
    except BaseException:
        with contextlib.suppress(Exception):
            stream.close()
        with contextlib.suppress(Exception):
            fs.delete_file(tmp)
        raise


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
    """Write OUTPUT/name as Parquet (through `staged`)."""
    import pyarrow.parquet as pq

    fs, root = open_fs(path)
    with staged(fs, root, name) as f:
        pq.write_table(table, f)


def write_json(path: str, name: str, obj) -> None:
    """Write OUTPUT/name as JSON (through `staged`)."""
    fs, root = open_fs(path)
    with staged(fs, root, name) as f:
        f.write((json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


def read_json(path: str, name: str):
    fs, root = open_fs(path)
    with fs.open_input_stream(f"{root}/{name}") as f:
        return json.loads(f.read())


@dataclass
class Parts:
    files: list[str]  # finished part files (paths inside the OUTPUT filesystem)
    rows: int
    id_type: Any  # pyarrow type of their id column (None when there are none)


def finished_parts(output: str) -> Parts:
    """Part files in OUTPUT with their total row count and id type, from the footers."""
    import pyarrow.fs as pafs

    fs, root = open_fs(output)
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        return Parts([], 0, None)
    files = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(root))
                   if is_part(i.base_name))
    footers = read_footers(fs, files, "part file {!r} in OUTPUT")
    for f, (_, schema) in zip(files, footers):
        if "id" not in schema.names:
            raise UsageError(f"cannot read part file {f!r} in OUTPUT: it has no 'id' column")
    return Parts(files, sum(n for n, _ in footers),
                 footers[0][1].field("id").type if footers else None)
