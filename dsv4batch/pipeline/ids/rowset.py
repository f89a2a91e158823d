"""Which input rows a resumed run still has to score: one bit per row of each input file.

The id scan (`scan`) streams to the driver the positions of the input rows whose id OUTPUT
already holds, and the driver sets their bits in a packed bitmap per file: 1 bit per input row
(12.5 MB per 100M rows), never a set of ids. Files whose rows are all written are not read
again; in the others `keep_pending` drops the written rows inside the read tasks, where Ray
Data's `row_hash` gives each row's position in its file (`hashing.row_index`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dsv4batch.pipeline.ids.hashing import row_index

KEY_SHIFT = 40  # row key = file index << KEY_SHIFT | row position in the file
ROW_MASK = (1 << KEY_SHIFT) - 1


@dataclass
class Pending:
    files: list[str]  # input files with rows left to score
    done: dict[str, np.ndarray] = field(default_factory=dict)  # path -> packed bits of written rows
    skipped: int = 0  # input rows whose id OUTPUT already holds


class RowBitmap:
    """Packed bits of written rows, per input file (grown on demand when row counts are unknown)."""

    def __init__(self, files: list[str], file_rows: list[int] | None):
        self.files, self.file_rows = files, file_rows
        self.bits: dict[int, np.ndarray] = {}

    def add(self, keys: np.ndarray) -> None:
        keys = np.asarray(keys, np.int64)
        files, rows = keys >> KEY_SHIFT, keys & ROW_MASK
        for f in np.unique(files).tolist():
            r = rows[files == f]
            size = (self.file_rows[f] if self.file_rows else int(r.max()) + 1) + 7 >> 3
            bits = self.bits.get(f)
            if bits is None or len(bits) < size:
                grown = np.zeros(max(size, 0 if bits is None else len(bits)), np.uint8)
                if bits is not None:
                    grown[:len(bits)] = bits
                self.bits[f] = bits = grown
            np.bitwise_or.at(bits, r >> 3, (1 << (r & 7)).astype(np.uint8))

    def pending(self) -> Pending:
        done, files, skipped = {}, [], 0
        for i, path in enumerate(self.files):
            bits = self.bits.get(i)
            n = 0 if bits is None else int(np.unpackbits(bits).sum())
            skipped += n
            if self.file_rows is not None and n == self.file_rows[i]:
                continue  # every row of this file is written: do not read it again
            files.append(path)
            if n:
                done[path] = bits
        return Pending(files, done, skipped)


def keep_pending(batch, done: dict[str, np.ndarray]):
    """Drop the rows whose bit is set (already written); needs Ray Data's `path`, `row_hash`."""
    import pyarrow as pa
    import pyarrow.compute as pc

    paths, hashes = batch["path"], batch["row_hash"].to_numpy()
    keep = np.ones(batch.num_rows, bool)
    for p in pc.unique(paths).to_pylist():
        bits = done.get(p)
        if bits is None:
            continue
        mask = pc.equal(paths, p).to_numpy(zero_copy_only=False)
        rows = row_index(p, hashes[mask])
        if (rows < 0).any():
            raise RuntimeError(f"cannot locate rows of {p!r} from Ray Data's row_hash (did Ray "
                               "change its row hash?); resume cannot skip written rows")
        written = np.zeros(len(rows), bool)
        inside = (rows >> 3) < len(bits)
        written[inside] = (bits[rows[inside] >> 3] >> (rows[inside] & 7)) & 1
        keep[mask] = ~written
    return batch.filter(pa.array(keep))
