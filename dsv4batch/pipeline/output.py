"""The OUTPUT folder's layout, all of it: names, what is ours, one temp-then-rename writer.

    part-<run>-<task>[-<k>].parquet   scores (`part_name`), each written under a temporary name
    _tmp-<uuid>.<name>.inprogress      a file being written (`staged`); readers skip it
    _job.json                          the run's configuration and input, written before scoring
    _lease.json                        the exclusive writer while a job runs (`lease`)
    _metrics.json, _SUCCESS            written last, only when every input row is accounted for
    output.jsonl                       `--output-format openai-batch`: the response lines, written
                                       before _SUCCESS (`openai_batch.write_output`)

Every file is written through `staged`: under a `_tmp-` name, renamed to its final name when
complete, so a file either exists whole under its final name or not at all. A part file's name
depends only on the run id, the write task index and its place in the task's rows: a retried
task replaces its own files. Only names of exactly these shapes are ever deleted, and part,
metrics and success files only when `_job.json` says dsv4batch wrote the folder
(`inspect_output`); every refusal happens before anything is deleted (`clear_output`).
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from dsv4batch.jobspec.errors import UsageError
from dsv4batch.pipeline.fs import open_fs, read_footers

JOB, METRICS, SUCCESS, LEASE = "_job.json", "_metrics.json", "_SUCCESS", "_lease.json"
RESULTS = "output.jsonl"  # `--output-format openai-batch`: built from the part files at the end
WRITER = "dsv4batch"  # `_job.json`'s "writer": the mark of a folder this tool wrote
PART = re.compile(r"part-[0-9a-f]{8}-\d{6}(-\d{4})?\.parquet")
TEMP = re.compile(r"_tmp-(probe-)?[0-9a-f]{32}(\..+\.inprogress)?")
LEASE_FILES = re.compile(re.escape(LEASE) + r"(\.takeover)?")


def part_name(run_id: str, task: int, k: int = 0) -> str:
    """The k-th part file of write task `task` of run `run_id`."""
    return f"part-{run_id}-{task:06d}" + (f"-{k:04d}" if k else "") + ".parquet"


def is_part(name: str) -> bool:
    return PART.fullmatch(name) is not None


@contextlib.contextmanager
def staged(fs, root: str, name: str):
    """A writable stream for `root/name`: written under a temporary name, renamed to `name`
    when the block exits normally, deleted when it raises."""
    tmp = f"{root}/_tmp-{uuid.uuid4().hex}.{name}.inprogress"
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


@dataclass
class OutputState:
    """What `inspect_output` found in OUTPUT and what `clear_output` will delete."""

    fs: Any
    root: str
    job: dict | None  # the recorded `_job.json` when dsv4batch wrote the folder
    resuming: bool  # OUTPUT holds a run to continue
    delete: list[str] = field(default_factory=list)  # names to delete before scoring


def read_job(fs, root: str) -> dict | None:
    """`_job.json` when it is dsv4batch's (a JSON object with our mark), else None."""
    try:
        with fs.open_input_stream(f"{root}/{JOB}") as f:
            job = json.loads(f.read())
    except Exception:  # noqa: BLE001 - missing, unreadable or not JSON: not a job of ours
        return None
    legacy = isinstance(job, dict) and {"version", "run_id", "result"} <= set(job)
    if isinstance(job, dict) and (job.get("writer") == WRITER or legacy) \
            and isinstance(job.get("result"), dict):
        return job
    return None


def inspect_output(path: str, overwrite: bool, resume: bool = False) -> OutputState:
    """Check OUTPUT may be written as asked, deleting nothing; create it; probe writability.

    Empty (nothing, or only what a run that wrote no part left: temporary files, `_job.json`):
    any run. Holding parts: `--resume` continues it, `--overwrite` replaces it, only when its
    `_job.json` is dsv4batch's and every file has one of our exact names; anything else is
    refused, naming the files."""
    import pyarrow.fs as pafs

    fs, root = open_fs(path)
    kind = fs.get_file_info(root).type
    if kind == pafs.FileType.File:
        raise UsageError(f"OUTPUT {path!r} is a file; it must be a folder")
    names = []
    if kind == pafs.FileType.Directory:
        names = [i.base_name for i in fs.get_file_info(pafs.FileSelector(root))
                 if not LEASE_FILES.fullmatch(i.base_name)]
    job = read_job(fs, root) if JOB in names else None
    temps = [n for n in names if TEMP.fullmatch(n)]
    ours = {JOB, METRICS, SUCCESS, RESULTS} if job is not None else set()
    if JOB in names and job is None:
        raise UsageError(f"OUTPUT {path!r}: its {JOB} was not written by dsv4batch (or is "
                         "damaged); refusing to write into it (give a new OUTPUT)")
    foreign = sorted(n for n in names if n not in temps and n not in ours and
                     not (job is not None and is_part(n)))
    if foreign:
        raise UsageError(f"OUTPUT {path!r} holds files dsv4batch did not write ({foreign[:5]})"
                         + ("" if job is not None else f" and no {JOB} of a dsv4batch run")
                         + "; refusing to write into it (give a new OUTPUT)")
    parts = [n for n in names if is_part(n)]
    if parts and not (overwrite or resume):
        raise UsageError(f"OUTPUT {path!r} is not empty; pass --resume to continue the run "
                         "in it or --overwrite to replace it")
    if resume and names and job is None:
        raise UsageError(f"OUTPUT {path!r} has no {JOB}: there is no run to resume")
    resuming = bool(resume and job is not None)
    delete = temps + [n for n in (SUCCESS, RESULTS) if n in names] if resuming else \
        [n for n in names if n in temps or n in ours or is_part(n)]
    probe = f"{root}/_tmp-probe-{uuid.uuid4().hex}"
    try:
        fs.create_dir(root, recursive=True)
        with fs.open_output_stream(probe) as f:
            f.write(b"ok")
        fs.delete_file(probe)
    except Exception as exc:
        raise UsageError(f"OUTPUT {path!r} is not writable: {exc}") from exc
    return OutputState(fs, root, job, resuming, delete)


def clear_output(state: OutputState) -> None:
    """Delete what `inspect_output` planned (after every check passed)."""
    for name in state.delete:
        with contextlib.suppress(FileNotFoundError):
            state.fs.delete_file(f"{state.root}/{name}")


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


def write_text(path: str, name: str, lines) -> None:
    """Write OUTPUT/name from an iterable of text lines (UTF-8, through `staged`)."""
    fs, root = open_fs(path)
    with staged(fs, root, name) as f:
        for line in lines:
            f.write(line.encode())


def read_json(path: str, name: str):
    fs, root = open_fs(path)
    with fs.open_input_stream(f"{root}/{name}") as f:
        return json.loads(f.read())


@dataclass
class Parts:
    files: list[str]  # finished part files (paths inside the OUTPUT filesystem)
    rows: int
    id_type: Any  # pyarrow type of their id column (None when there are none)


def finished_parts(output: str, columns: list[str] | None = None) -> Parts:
    """Part files in OUTPUT with their total row count and id type, from the footers.

    `columns`: the output columns the run writes (`schema.output_names` + kept columns); a part
    file with other columns is refused by name (it is not this run's)."""
    import pyarrow.fs as pafs

    fs, root = open_fs(output)
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        return Parts([], 0, None)
    files = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(root))
                   if is_part(i.base_name))
    footers = read_footers(fs, files, "part file {!r} in OUTPUT")
    for f, schema in zip(files, (ft.schema for ft in footers)):
        if "id" not in schema.names:
            raise UsageError(f"cannot read part file {f!r} in OUTPUT: it has no 'id' column")
        if columns is not None and schema.names != list(columns):
            raise UsageError(f"part file {f!r} in OUTPUT has columns {schema.names}, not this "
                             f"run's {list(columns)}: it was not written by this run")
    return Parts(files, sum(ft.rows for ft in footers),
                 footers[0].schema.field("id").type if footers else None)
