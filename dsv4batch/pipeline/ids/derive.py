"""Deterministic row ids for inputs without an id column: `<file relative to INPUT>:<row>`.

The format is written once, here (`derived_ids`); the read step (`DeriveIds`, from Ray Data's
`path` + `row_hash`) and the id scan (`scan`, from row positions) both call it. If Ray ever
changes its row hash, the inverted values are no plausible row positions and ids fall back to
`<file>#<hash hex>` (still deterministic and unique).
"""

from __future__ import annotations

import posixpath

from dsv4batch.jobspec import schema as S
from dsv4batch.pipeline.ids.hashing import row_index


def relative(root: str, path: str) -> str:
    """`path` relative to the INPUT folder `root` (its base name when outside it)."""
    root = root.rstrip("/")
    rel = posixpath.relpath(path, root) if root else path
    return posixpath.basename(path) if rel in (".", "") or rel.startswith("..") else rel


def derived_ids(rel: str, rows, hashes=None) -> list[str]:
    """Ids of rows at positions `rows` of file `rel`; a row < 0 falls back to its hash."""
    if hashes is None:
        return [f"{rel}:{r}" for r in rows]
    return [f"{rel}:{r}" if r >= 0 else f"{rel}#{h:016x}" for r, h in zip(rows, hashes)]


class DeriveIds:
    """Adds column `id_column` from Ray Data's `path` + `row_hash`, and drops those two."""

    @staticmethod
    def spec(id_column: str) -> S.StageSpec:
        return S.StageSpec("derive_ids", ("path", "row_hash"), (id_column,))

    def __init__(self, root: str, id_column: str = S.ID):
        self.root, self.id_column = root, id_column

    def __call__(self, batch):
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        S.check_columns("derive_ids", ("path", "row_hash"), batch.column_names, "batch")
        paths = batch["path"]
        hashes = batch["row_hash"].to_numpy()
        ids = np.empty(batch.num_rows, dtype=object)
        for p in pc.unique(paths).to_pylist():
            mask = pc.equal(paths, p).to_numpy(zero_copy_only=False)
            ids[mask] = derived_ids(relative(self.root, p), row_index(p, hashes[mask]).tolist(),
                                    hashes[mask].tolist())
        out = batch.drop_columns(["path", "row_hash"])
        return out.append_column(self.id_column, pa.array(ids.tolist(), pa.string()))


def derive_ids(batch, root: str, id_column: str):
    """`DeriveIds` as a plain function for `map_batches`."""
    return DeriveIds(root, id_column)(batch)
