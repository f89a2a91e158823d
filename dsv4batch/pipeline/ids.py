"""Deterministic row ids for inputs without an id column: `<file relative to INPUT>:<row>`.

`read_parquet(include_paths=True, include_row_hash=True)` gives each row its file and a uint64
`row_hash` = splitmix64(md5(path)[:8] + row), where row is the row's position in its file. The
finalizer is a bijection, so `row_index` inverts it (tests check it against Ray's own function);
if Ray ever changes the hash, the inverted values are no plausible row positions and ids fall
back to `<file>#<hash hex>` (still deterministic and unique).
"""

from __future__ import annotations

import hashlib
import posixpath

from dsv4batch.pipeline import schema as S

_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_I1, _I2 = 0x96DE1B173F119089, 0x319642B2D24D8EC3  # modular inverses of _M1, _M2 (mod 2**64)


def _seed(path: str) -> int:
    return int.from_bytes(hashlib.md5(path.encode("utf-8")).digest()[:8], "little")


def _mix(z):
    import numpy as np

    z = z.copy()
    z ^= z >> np.uint64(30)
    z *= np.uint64(_M1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_M2)
    z ^= z >> np.uint64(31)
    return z


def _unmix(z):
    import numpy as np

    z = z.copy()
    z ^= (z >> np.uint64(31)) ^ (z >> np.uint64(62))
    z *= np.uint64(_I2)
    z ^= (z >> np.uint64(27)) ^ (z >> np.uint64(54))
    z *= np.uint64(_I1)
    z ^= (z >> np.uint64(30)) ^ (z >> np.uint64(60))
    return z


def row_index(path: str, hashes):
    """Row positions in `path` for Ray Data row hashes; -1 where a hash does not invert."""
    import numpy as np

    with np.errstate(over="ignore"):
        rows = _unmix(np.asarray(hashes, np.uint64)) - np.uint64(_seed(path))
    # another hash function would leave random 64-bit numbers here, not row positions
    return np.where(rows < 2**48, rows, np.uint64(2**64 - 1)).astype(np.int64)


class DeriveIds:
    """Adds column `id_column` from Ray Data's `path` + `row_hash`, and drops those two."""

    @staticmethod
    def spec(id_column: str) -> S.StageSpec:
        return S.StageSpec("derive_ids", ("path", "row_hash"), (id_column,))

    def __init__(self, root: str, id_column: str = S.ID):
        self.root = root.rstrip("/")
        self.id_column = id_column

    def relative(self, path: str) -> str:
        rel = posixpath.relpath(path, self.root) if self.root else path
        return posixpath.basename(path) if rel in (".", "") or rel.startswith("..") else rel

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
            rel = self.relative(p)
            ids[mask] = [f"{rel}:{r}" if r >= 0 else f"{rel}#{h:016x}"
                         for r, h in zip(row_index(p, hashes[mask]).tolist(),
                                         hashes[mask].tolist())]
        out = batch.drop_columns(["path", "row_hash"])
        return out.append_column(self.id_column, pa.array(ids.tolist(), pa.string()))
