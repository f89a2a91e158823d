"""Id checks with Ray Data before anything is scored: duplicate and null ids in INPUT and, on
`--resume`, the input rows whose id OUTPUT already holds.

INPUT's ids (each tagged with its row's file and position) and, when resuming, the ids of
OUTPUT's finished part files are read in plain Ray Data tasks, each id hashed to one of P
partitions (P grows with the row count: 250k ids per partition). Ray Data brings each partition
together (`groupby` on the partition number, a shuffle of P groups), and each partition is
grouped by id with Arrow's vectorized `group_by` (Ray Data's own per-id aggregation loops over
the groups in Python). Counting each id in INPUT and in OUTPUT finds ids repeated in INPUT or
null (refused, with examples), ids OUTPUT holds twice or INPUT lacks (refused: OUTPUT is not a
run over this input), and the rows already written, whose positions stream to the driver's
`RowBitmap`. The ids stay in Ray's object store and workers: the driver receives examples and
row positions, never the id set.
"""

from __future__ import annotations

import math

from dsv4batch.jobspec import schema as S
from dsv4batch.jobspec.config import JobConfig
from dsv4batch.jobspec.errors import UsageError
from dsv4batch.pipeline.ids.derive import derived_ids, relative
from dsv4batch.pipeline.ids.hashing import mix64
from dsv4batch.pipeline.ids.rowset import KEY_SHIFT, Pending, RowBitmap

IN, DONE, KEY, PART = "__in", "__done", "__key", "__part"
ROWS_PER_PARTITION = 250_000  # ids per partition: what one reduce task and the driver hold at once
CHUNK_ROWS = 65_536  # rows per block read: a task's memory does not grow with its file
FILES_PER_TASK = 8
EXAMPLES = 3
DONE_KIND, KINDS = 0, ("done", "null", "dup_in", "dup_out", "orphan")


def partition_of(ids, parts: int):
    """A stable partition number per id (same in every process; any such function is correct,
    a good hash only balances the partitions). Integers are mixed directly; strings and bytes
    by a position-weighted byte sum. Null ids go to partition 0."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(ids)
    if parts == 1 or n == 0:
        return np.zeros(n, np.int64)
    if pa.types.is_integer(ids.type):
        v = pc.fill_null(ids, 0).to_numpy(zero_copy_only=False).astype(np.uint64)
    else:
        b = pc.fill_null(ids.cast(pa.large_binary()), b"")
        b = b.combine_chunks() if isinstance(b, pa.ChunkedArray) else b
        offsets = np.frombuffer(b.buffers()[1], np.int64)[b.offset:b.offset + n + 1]
        data = np.frombuffer(b.buffers()[2], np.uint8)[offsets[0]:offsets[-1]]
        lengths = np.diff(offsets).astype(np.uint64)
        pos = np.arange(len(data)) - np.repeat(offsets[:-1] - offsets[0], lengths.astype(np.int64))
        contrib = data.astype(np.uint64) * (pos.astype(np.uint64) * np.uint64(0x9E3779B1) + 1)
        sums = np.zeros(n, np.uint64)
        np.add.at(sums, np.repeat(np.arange(n), lengths.astype(np.int64)), contrib)
        v = sums ^ (lengths << np.uint64(40))
    with np.errstate(over="ignore"):
        return (mix64(v) % np.uint64(parts)).astype(np.int64)


def read_keys(batch, filesystem, id_column: str | None, root: str, parts: int, id_type,
              output: bool = False, fmt: str = "parquet", text_columns: tuple = ()):
    """Files -> blocks of (id, in, done, key, partition), streamed one chunk at a time.

    Ids are cast to `id_type` (INPUT's one id type). INPUT files: in=1, done=0, key = file
    index << 40 | row position; with `id_column` None the ids are derived like
    `derive.DeriveIds` ('<file>:<row>'). OUTPUT part files (`output`): in=0, done=1, key=-1. Reading the id column with
    pyarrow in plain tasks gives row positions directly and starts much faster than
    `ray.data.read_parquet` for a scan of one column. JSONL/CSV files (`fmt`) are streamed
    with the readers and options `formats` shares with Ray's read; their row counts (`rows`,
    from the driver's scan) give derived ids without reading them again.
    """
    import numpy as np
    import pyarrow as pa

    side = 0 if output else 1
    rows = batch["rows"].to_pylist() if "rows" in batch.column_names else None
    for i, (path, index) in enumerate(zip(batch["path"].to_pylist(),
                                          batch["index"].to_pylist())):
        offset = 0
        for ids in _id_chunks(filesystem, path, fmt, id_column, root, rows[i] if rows else None,
                              text_columns):
            n = len(ids)
            ids = ids.cast(id_type)
            keys = ((index << KEY_SHIFT) + offset + np.arange(n, dtype=np.int64) if side
                    else np.full(n, -1, np.int64))
            offset += n
            yield pa.table({S.ID: ids, IN: pa.array(np.full(n, side, np.int64)),
                            DONE: pa.array(np.full(n, 1 - side, np.int64)),
                            KEY: pa.array(keys), PART: pa.array(partition_of(ids, parts))})


def _id_chunks(fs, path: str, fmt: str, id_column: str | None, root: str, rows, text_columns):
    """One file's ids [n] in row order, a chunk at a time (derived from `rows` or the footer
    when `id_column` is None)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dsv4batch.pipeline.formats import iter_tables

    if id_column is None and rows is not None:
        rel = relative(root, path)
        for o in range(0, rows, CHUNK_ROWS):
            yield pa.array(derived_ids(rel, range(o, min(o + CHUNK_ROWS, rows))), pa.string())
        return
    if fmt != "parquet":
        yield from (t.column(0) for t in iter_tables(fs, path, fmt, text_columns, [id_column]))
        return
    with fs.open_input_file(path) as fh:
        pf = pq.ParquetFile(fh)
        if id_column is None:  # derived ids: only the row count is needed
            yield from _id_chunks(fs, path, fmt, None, root, pf.metadata.num_rows, ())
            return
        yield from (b.column(0) for b in pf.iter_batches(CHUNK_ROWS, columns=[id_column]))


def _files(paths: list[str], rows: list[int] | None = None, **kwargs):
    """A dataset of the files to read (path, index[, rows]), a few per read task."""
    import ray

    items = [{"path": p, "index": i, **({"rows": rows[i]} if rows else {})}
             for i, p in enumerate(paths)]
    return ray.data.from_items(items).map_batches(
        read_keys, fn_kwargs=kwargs, batch_format="pyarrow", batch_size=FILES_PER_TASK)


def classify(partition):
    """One partition's rows -> what the driver needs: problems (with the id) and written rows.

    kind: 0 written row (key = its position), 1 null id, 2 id repeated in INPUT, 3 id repeated
    in OUTPUT, 4 id in OUTPUT but not in INPUT; n: the rows involved.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    g = partition.group_by(S.ID).aggregate([(IN, "sum"), (DONE, "sum"), (KEY, "max")])
    n_in, n_done = g[f"{IN}_sum"], g[f"{DONE}_sum"]
    kinds = pc.case_when(
        pc.make_struct(pc.and_(pc.equal(n_in, 1), pc.equal(n_done, 1)), pc.is_null(g[S.ID]),
                       pc.greater(n_in, 1), pc.greater(n_done, 1),
                       pc.and_(pc.greater(n_done, 0), pc.equal(n_in, 0))),
        *[pa.scalar(i, pa.int8()) for i in range(len(KINDS))])
    keep = pc.is_valid(kinds)
    g, kinds = g.filter(keep).combine_chunks(), kinds.filter(keep).combine_chunks()
    problem = pc.not_equal(kinds, DONE_KIND)
    ids = pa.array([repr(v) for v in g[S.ID].filter(problem).to_pylist()], pa.string())
    shown = pc.replace_with_mask(pa.nulls(len(g), pa.string()), problem, ids) if len(ids) \
        else pa.nulls(len(g), pa.string())
    from_output = pc.or_(pc.equal(kinds, 3), pc.equal(kinds, 4))
    counts = pc.if_else(from_output, g[f"{DONE}_sum"], g[f"{IN}_sum"])
    return pa.table({"kind": kinds, "id": shown, "n": counts, "key": g[f"{KEY}_max"]})


MESSAGES = {
    "null": "INPUT has {total} row(s) with a null id in column {col!r}; every row needs an id",
    "dup_in": "INPUT has {count} id(s) on more than one row in column {col!r}, e.g. {examples}; "
              "ids must be unique (drop the duplicates, or use another --id-column)",
    "dup_out": "OUTPUT holds {count} id(s) more than once, e.g. {examples}; it is not a clean "
               "dsv4batch run: score into a new OUTPUT",
    "orphan": "OUTPUT holds {count} id(s) that INPUT does not have, e.g. {examples}; --resume "
              "needs the INPUT of the first run",
}


def scan_ids(config: JobConfig, info, done_files: list[str], done_rows: int,
             output_fs=None, id_type=None) -> Pending:
    """Refuse bad ids (UsageError) and find the rows OUTPUT already holds; runs on Ray Data."""
    import numpy as np
    from ray.data.context import ShuffleStrategy

    derive = config.id_column not in info.schema.names
    parts = max(1, math.ceil(((info.num_rows or 0) + done_rows) / ROWS_PER_PARTITION))
    expected = info.id_type
    text = info.format != "parquet"
    ds = _files(info.files, info.file_rows if text else None, filesystem=info.filesystem,
                root=info.root, parts=parts, id_column=None if derive else config.id_column,
                id_type=expected, fmt=info.format, text_columns=info.text_columns)
    if done_files:
        if id_type is not None and S.id_kind(id_type) != S.id_kind(expected):
            raise UsageError(f"OUTPUT's ids have type {id_type}, INPUT's {expected}: OUTPUT is "
                             "not a run over this INPUT")
        if output_fs is None:
            import pyarrow.fs as pafs

            output_fs = pafs.LocalFileSystem()
        ds = ds.union(_files(done_files, filesystem=output_fs, root="", id_column=S.ID,
                             parts=parts, id_type=expected, output=True))
    # P groups: the task-based sort shuffle starts far faster than the actor-based hash shuffle
    ds.context.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    found = ds.groupby(PART, num_partitions=parts).map_groups(classify, batch_format="pyarrow")
    written = RowBitmap(info.files, info.file_rows)
    problems: dict[str, list] = {}
    for b in found.iter_batches(batch_format="pyarrow", batch_size=CHUNK_ROWS):
        kinds = b["kind"].to_numpy(zero_copy_only=False)
        written.add(b["key"].to_numpy()[kinds == DONE_KIND])
        for i in np.flatnonzero(kinds != DONE_KIND).tolist():
            p = problems.setdefault(KINDS[kinds[i]], [0, 0, []])
            n = b["n"][i].as_py()
            p[0], p[1] = p[0] + 1, p[1] + n
            if len(p[2]) < EXAMPLES:
                p[2].append(f"{b['id'][i].as_py()} ({n} rows)")
    for kind in ("null", "dup_in", "dup_out", "orphan"):
        if kind in problems:
            count, total, examples = problems[kind]
            raise UsageError(MESSAGES[kind].format(count=count, total=total, col=config.id_column,
                                                   examples=", ".join(examples)))
    return written.pending()
