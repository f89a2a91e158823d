"""Build `sample.parquet`, the bundled sample that `make run` scores (offline, deterministic).

Real English prose that ships with Python: the reference topics of `pydoc_data.topics` (the
language reference behind `help()`) and the docstrings of stdlib modules. Paragraphs are
packed into rows whose token counts (DSv4 tokenizer, bos excluded) follow a seeded log-normal
distribution clipped to [50, 2000], so the sample has many short rows and a long tail.

    python -m dsv4batch.data.make_sample [--rows 220] [--out dsv4batch/data/sample.parquet]
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import random
import re

MIN_TOKENS, MAX_TOKENS = 50, 2000
MODULES = ("argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv",
           "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions",
           "functools", "heapq", "http.client", "inspect", "ipaddress", "itertools", "json",
           "logging", "multiprocessing", "optparse", "os", "pathlib", "pickle", "pydoc",
           "random", "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess",
           "tarfile", "textwrap", "threading", "typing", "unittest", "urllib.parse", "uuid",
           "warnings", "zipfile")


def documents() -> list[tuple[str, str]]:
    """(source, text) pairs: pydoc topics, then module docstrings, in a fixed order."""
    from pydoc_data.topics import topics

    docs = [(f"pydoc_data.topics:{k}", topics[k]) for k in sorted(topics)]
    for name in MODULES:
        try:
            doc = importlib.import_module(name).__doc__ or ""
        except ImportError:
            continue
        docs.append((f"module:{name}", doc))
    return docs


def paragraphs(text: str) -> list[str]:
    paras = [re.sub(r"[ \t]+\n", "\n", p).strip("\n") for p in re.split(r"\n\s*\n", text)]
    return [p for p in paras if p.strip()]


def build(rows: int, seed: int = 0):
    import pyarrow as pa

    from dsv4batch.model.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    rng = random.Random(seed)

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    out = []
    for source, text in documents():
        chunk: list[str] = []
        target = 0
        for para in paragraphs(text):
            if not chunk:
                target = int(min(MAX_TOKENS, max(MIN_TOKENS, math.exp(rng.gauss(math.log(110), 0.8)))))
            candidate = "\n\n".join([*chunk, para])
            n = count(candidate)
            if n > MAX_TOKENS and chunk:
                out.append((source, "\n\n".join(chunk)))
                chunk, candidate, n = [para], para, count(para)
            else:
                chunk.append(para)
            if n >= target:
                out.append((source, candidate))
                chunk = []
        if chunk:
            out.append((source, "\n\n".join(chunk)))
    kept = [(s, t, count(t)) for s, t in out]
    kept = [k for k in kept if MIN_TOKENS <= k[2] <= MAX_TOKENS]
    rng.shuffle(kept)
    kept = sorted(kept[:rows], key=lambda k: (k[0], k[1]))
    if len(kept) < rows:
        raise RuntimeError(f"only {len(kept)} rows of {MIN_TOKENS}-{MAX_TOKENS} tokens available")
    return pa.table({
        "id": [f"sample-{i:04d}" for i in range(len(kept))],
        "prompt": [t for _, t, _ in kept],
        "source": [s for s, _, _ in kept],
        "num_text_tokens": pa.array([n for _, _, n in kept], pa.int32()),
    })


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=220)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "sample.parquet"))
    args = parser.parse_args(argv)
    import pyarrow.parquet as pq

    table = build(args.rows, args.seed)
    pq.write_table(table, args.out, compression="zstd")
    n = table["num_text_tokens"].to_pylist()
    print(f"wrote {args.out}: {table.num_rows} rows, {sum(n)} tokens "
          f"(min {min(n)}, median {sorted(n)[len(n) // 2]}, max {max(n)}), "
          f"{os.path.getsize(args.out)} bytes")


if __name__ == "__main__":
    main()
