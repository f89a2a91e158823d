"""One safetensors file, read without mapping it: the header parsed at once, each tensor's bytes
(or one rank's slice of them) read with pread straight into the memory that will hold them.

The header is checked whole when the file is opened, so no later read can go astray: a regular
file (`config.open_regular`), a header within the format's limit and the file, and every
tensor's dtype, shape and byte range consistent and inside the file (a file cut short is named
here, not at the first read of its missing part)."""

from __future__ import annotations

import json
import os
import struct

import torch

from .config import ModelLoadError, open_regular

MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
          "F8_E8M0": torch.float8_e8m0fnu}


def _entry(e: dict) -> tuple:
    """(torch dtype, shape, begin, end) of a header entry; KeyError / TypeError / ValueError when
    it lacks one of them."""
    begin, end = e["data_offsets"]
    return DTYPES[e["dtype"]], tuple(e["shape"]), begin, end


class TensorFile:
    """One safetensors file: its header (names, dtypes, shapes, byte ranges) parsed at once; a
    tensor's bytes are read (pread) on demand, straight into the memory that will hold them."""

    def __init__(self, path: str):
        self.path, self.name, self._fd = path, os.path.basename(path), None
        fd = open_regular(path)  # a FIFO or device is refused here, by name
        try:
            with os.fdopen(fd, "rb") as fh:
                self.file_size = os.fstat(fh.fileno()).st_size
                (size,) = struct.unpack("<Q", fh.read(8))
                if size > min(MAX_HEADER, self.file_size - 8):
                    raise ValueError(f"a {size}-byte header in a {self.file_size}-byte file (the format's "
                                     f"limit is {MAX_HEADER})")
                header = json.loads(fh.read(size))
            header.pop("__metadata__", None)
            self.data_start = 8 + size
            self.entries = {n: _entry(e) for n, e in header.items()}
        except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError, MemoryError,
                RecursionError) as exc:
            raise ModelLoadError(f"{path} is not a readable safetensors file ({type(exc).__name__}: {exc})") from exc
        for name, entry in self.entries.items():
            self._check_entry(name, *entry)

    def _check_entry(self, name: str, dtype, shape, begin, end) -> None:
        """One header entry: integer dims and offsets, as many bytes as its dtype and shape need,
        all of them inside the file."""
        ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (*shape, begin, end))
        if not ints:
            raise ModelLoadError(f"tensor {name!r} in {self.name}: shape {shape} and offsets [{begin}, {end}] "
                                 "must be non-negative integers")
        if end - begin != torch.Size(shape).numel() * dtype.itemsize:
            raise ModelLoadError(f"tensor {name!r} in {self.name}: {end - begin} bytes for {dtype} {shape}")
        if self.data_start + end > self.file_size:
            raise ModelLoadError(f"{self.name} is truncated: tensor {name!r} ends at byte {self.data_start + end} "
                                 f"of a {self.file_size}-byte file")

    def keys(self) -> set[str]:
        return set(self.entries)

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def nbytes(self, name: str) -> int:
        return self.entries[name][3] - self.entries[name][2]

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` along its first dim, read alone (a bounded piece of
        a large tensor)."""
        dtype, shape = self.entries[name][:2]
        row = torch.Size(shape[1:]).numel() * dtype.itemsize
        out = torch.empty((stop - start, *shape[1:]), dtype=dtype)
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        self._pread(name, view, self.data_start + self.entries[name][2] + start * row)
        return out

    def read_into(self, name: str, out: torch.Tensor, part: tuple[int, int] | None = None) -> torch.Tensor:
        """Copy tensor `name` into `out` (same dtype, contiguous) and return `out`.

        part: None (the whole tensor, `out` of its shape) or (dim, rank): rank's contiguous block
        along dim, `out.shape[dim]` wide (a tensor-parallel slice; only its bytes are read: one
        read per index of the dims before `dim`)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        shape, offset = self.entries[name][1], self.data_start + self.entries[name][2]
        view = memoryview(out.detach().reshape(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        if part is None:
            return self._pread(name, view, offset) or out
        dim, rank = part
        inner = torch.Size(shape[dim + 1:]).numel() * out.element_size()
        run, stride = out.shape[dim] * inner, shape[dim] * inner
        offset += rank * run
        for i in range(torch.Size(shape[:dim]).numel()):
            self._pread(name, view[i * run:(i + 1) * run], offset + i * stride)
        return out

    def _pread(self, name: str, view: memoryview, offset: int) -> None:
        while len(view):
            got = os.preadv(self._fd, [view], offset)
            if got == 0:
                raise ModelLoadError(f"{self.name} is truncated: tensor {name!r} ends past the end of the file")
            view, offset = view[got:], offset + got

    def read(self, name: str, into: torch.Tensor | None = None, part: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name` (or its `part`, see `read_into`) as a new tensor, or copied into `into`
        (its shape; any dtype, converted): directly when `into` has the stored dtype and is
        contiguous, else through one temporary."""
        dtype, shape = self.entries[name][:2]
        if into is not None and into.dtype == dtype and into.is_contiguous():
            return self.read_into(name, into, part)
        if part is not None:
            shape = list(shape)
            shape[part[0]] = into.shape[part[0]]
        tmp = self.read_into(name, torch.empty(shape, dtype=dtype), part)
        if into is None:
            return tmp
        with torch.no_grad():
            return into.copy_(tmp)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
