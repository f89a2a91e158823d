"""64-bit mixing shared by the id code: Ray Data's row hash (and its inverse), id partitions.

`read_parquet(include_paths=True, include_row_hash=True)` gives each row a uint64 `row_hash` =
splitmix64(md5(path)[:8] + row), where row is the row's position in its file. The finalizer is
a bijection, so `row_index` inverts it (tests check it against Ray's own function).
"""

from __future__ import annotations

import hashlib

import numpy as np

_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_I1, _I2 = 0x96DE1B173F119089, 0x319642B2D24D8EC3  # modular inverses of _M1, _M2 (mod 2**64)


def path_seed(path: str) -> int:
    """Ray Data's per-file seed of the row hash: md5(path)[:8], little-endian."""
    return int.from_bytes(hashlib.md5(path.encode("utf-8")).digest()[:8], "little")


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array (a bijection; a copy is returned)."""
    z = z.copy()
    z ^= z >> np.uint64(30)
    z *= np.uint64(_M1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_M2)
    z ^= z >> np.uint64(31)
    return z


def unmix64(z: np.ndarray) -> np.ndarray:
    """The inverse of `mix64`."""
    z = z.copy()
    z ^= (z >> np.uint64(31)) ^ (z >> np.uint64(62))
    z *= np.uint64(_I2)
    z ^= (z >> np.uint64(27)) ^ (z >> np.uint64(54))
    z *= np.uint64(_I1)
    z ^= (z >> np.uint64(30)) ^ (z >> np.uint64(60))
    return z


def row_index(path: str, hashes) -> np.ndarray:
    """Row positions [n] int64 in `path` for Ray Data row hashes [n]; -1 where a hash does not
    invert to a plausible position (Ray changed its row hash)."""
    with np.errstate(over="ignore"):
        rows = unmix64(np.asarray(hashes, np.uint64)) - np.uint64(path_seed(path))
    # another hash function would leave random 64-bit numbers here, not row positions
    return np.where(rows < 2**48, rows, np.uint64(2**64 - 1)).astype(np.int64)


def row_hash(path: str, start: int, n: int) -> np.ndarray:
    """Ray Data's Parquet row hashes [n] uint64 of rows start .. start + n - 1 of `path` (the
    JSONL/CSV reader gives its rows the same, so `row_index` and resume treat every format alike)."""
    rows = np.arange(start, start + n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return mix64(rows + np.uint64(path_seed(path)))
