"""Id checks with Ray Data before anything is scored: duplicate and null ids in INPUT and, on
`--resume`, the input rows whose id OUTPUT already holds.

One group-by-id over the union of INPUT's ids (each tagged with its row's file and position)
and, when resuming, the ids of OUTPUT's finished part files, read in plain Ray Data tasks.
Each group counts the id in INPUT and in OUTPUT, so one shuffle finds ids repeated in INPUT or
null (refused, with examples), ids OUTPUT holds twice or INPUT lacks (refused: OUTPUT is not a
run over this input), and the rows already written, whose positions stream to the driver's
`RowBitmap`. The ids stay in Ray's object store and workers: the driver receives examples and
row positions, never the id set.
"""

from __future__ import annotations

import math

from dsv4batch.pipeline import schema as S
from dsv4batch.pipeline.config import ScoreConfig, UsageError
from dsv4batch.pipeline.rowset import KEY_SHIFT, Pending, RowBitmap

IN, DONE, KEY = "__in", "__done", "__key"
ROWS_PER_PARTITION = 2_000_000
CHUNK_ROWS = 65_536  # rows per block read: a task's memory does not grow with its file
FILES_PER_TASK = 8
EXAMPLES = 3


def read_keys(batch, filesystem, id_column: str | None, root: str, id_type=None):
    """Files -> blocks of (id, in, done, key), streamed one chunk at a time.

    INPUT files (`id_type` None): in=1, done=0, key = file index << 40 | row position; with
    `id_column` None the ids are derived like `ids.DeriveIds` ('<file>:<row>'). OUTPUT part
    files (`id_type` given: INPUT's id type): in=0, done=1, key=-1. Reading the id column with
    pyarrow in plain tasks gives row positions directly and starts much faster than
    `ray.data.read_parquet` for a scan of one column.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dsv4batch.pipeline.ids import DeriveIds

    side = 0 if id_type is not None else 1
    for path, index in zip(batch["path"].to_pylist(), batch["index"].to_pylist()):
        with filesystem.open_input_file(path) as fh:
            pf, offset = pq.ParquetFile(fh), 0
            if id_column is None:  # derived ids: only the row count is needed
                total = pf.metadata.num_rows
                chunks = (range(o, min(o + CHUNK_ROWS, total)) for o in range(0, total, CHUNK_ROWS))
                rel = DeriveIds(root).relative(path)
                chunks = (pa.array([f"{rel}:{r}" for r in c], pa.string()) for c in chunks)
            else:
                chunks = (b.column(0) for b in pf.iter_batches(CHUNK_ROWS, columns=[id_column]))
            for ids in chunks:
                n = len(ids)
                keys = ((index << KEY_SHIFT) + offset + np.arange(n, dtype=np.int64) if side
                        else np.full(n, -1, np.int64))
                offset += n
                yield pa.table({S.ID: ids.cast(id_type) if id_type is not None else ids,
                                IN: pa.array(np.full(n, side, np.int64)),
                                DONE: pa.array(np.full(n, 1 - side, np.int64)),
                                KEY: pa.array(keys)})


def _files(paths: list[str], **kwargs):
    """A dataset of the files to read (path, index), a few per read task."""
    import ray

    items = [{"path": p, "index": i} for i, p in enumerate(paths)]
    return ray.data.from_items(items).map_batches(
        read_keys, fn_kwargs=kwargs, batch_format="pyarrow", batch_size=FILES_PER_TASK)


def classify(batch):
    """Per id group -> only what the driver needs: problems (with the id) and written rows."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n_in, n_done = batch[f"sum({IN})"], batch[f"sum({DONE})"]
    kinds = pc.case_when(
        pc.make_struct(pc.is_null(batch[S.ID]), pc.greater(n_in, 1), pc.greater(n_done, 1),
                       pc.and_(pc.greater(n_done, 0), pc.equal(n_in, 0)),
                       pc.and_(pc.equal(n_in, 1), pc.equal(n_done, 1))),
        "null", "dup_in", "dup_out", "orphan", "done")
    keep = pc.is_valid(kinds)
    rows = batch.filter(keep)
    kinds = kinds.filter(keep)
    problem = pc.not_equal(kinds, "done").to_pylist()
    ids = [repr(v) if p else None for v, p in zip(rows[S.ID].to_pylist(), problem)]
    from_output = pc.or_(pc.equal(kinds, "dup_out"), pc.equal(kinds, "orphan"))
    counts = pc.if_else(from_output, rows[f"sum({DONE})"], rows[f"sum({IN})"])
    return pa.table({"kind": kinds, "id": pa.array(ids, pa.string()), "n": counts,
                     "key": rows[f"max({KEY})"]})


MESSAGES = {
    "null": "INPUT has {total} row(s) with a null id in column {col!r}; every row needs an id",
    "dup_in": "INPUT has {count} id(s) on more than one row in column {col!r}, e.g. {examples}; "
              "ids must be unique (drop the duplicates, or use another --id-column)",
    "dup_out": "OUTPUT holds {count} id(s) more than once, e.g. {examples}; it is not a clean "
               "dsv4batch run: score into a new OUTPUT",
    "orphan": "OUTPUT holds {count} id(s) that INPUT does not have, e.g. {examples}; --resume "
              "needs the INPUT of the first run",
}


def scan_ids(config: ScoreConfig, info, done_files: list[str], done_rows: int,
             output_fs=None, id_type=None) -> Pending:
    """Refuse bad ids (UsageError) and find the rows OUTPUT already holds; runs on Ray Data."""
    import pyarrow as pa
    from ray.data.aggregate import Max, Sum
    from ray.data.context import ShuffleStrategy

    derive = config.id_column not in info.schema.names
    ds = _files(info.files, filesystem=info.filesystem, root=info.root,
                id_column=None if derive else config.id_column)
    if done_files:
        expected = pa.string() if derive else info.schema.field(config.id_column).type
        if id_type is not None and id_type != expected:
            raise UsageError(f"OUTPUT's ids have type {id_type}, INPUT's {expected}: OUTPUT is "
                             "not a run over this INPUT")
        if output_fs is None:
            import pyarrow.fs as pafs

            output_fs = pafs.LocalFileSystem()
        ds = ds.union(_files(done_files, filesystem=output_fs, root="", id_column=S.ID,
                             id_type=expected))
    # the task-based sort shuffle: for two small columns it starts much faster than the
    # actor-based hash shuffle, and its partitions bound each reduce task's memory
    ds.context.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    rows = (info.num_rows or 0) + done_rows
    groups = ds.groupby(S.ID, num_partitions=max(1, math.ceil(rows / ROWS_PER_PARTITION)))
    found = groups.aggregate(Sum(IN), Sum(DONE), Max(KEY)).map_batches(
        classify, batch_format="pyarrow", batch_size=None)
    written = RowBitmap(info.files, info.file_rows)
    problems: dict[str, list] = {}
    for b in found.iter_batches(batch_format="pyarrow", batch_size=65536):
        kinds = b["kind"].to_pylist()
        done = [i for i, k in enumerate(kinds) if k == "done"]
        if done:
            written.add(b["key"].to_numpy()[done])
        for i, k in enumerate(kinds):
            if k != "done":
                p = problems.setdefault(k, [0, 0, []])
                p[0], p[1] = p[0] + 1, p[1] + b["n"][i].as_py()
                if len(p[2]) < EXAMPLES:
                    p[2].append(f"{b['id'][i].as_py()} ({b['n'][i].as_py()} rows)")
    for kind in ("null", "dup_in", "dup_out", "orphan"):
        if kind in problems:
            count, total, examples = problems[kind]
            raise UsageError(MESSAGES[kind].format(count=count, total=total, col=config.id_column,
                                                   examples=", ".join(examples)))
    return written.pending()
