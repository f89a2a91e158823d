"""Tokenization of lm-eval requests, the way lm-eval's `hf` backend does it on the same folder.

lm-eval's `hf` backend loads `AutoTokenizer.from_pretrained(PATH)` and encodes with
`tokenizer.encode(text, **kw)`, where kw is `add_special_tokens=<flag>` when the caller or the
`add_bos_token` model argument sets it, and nothing (the tokenizer's own default) otherwise;
text that starts with the bos string is encoded without special tokens. The loglikelihood
prefix (an empty context, the first rolling window) is `prefix_token_id`, else the tokenizer's
bos id, else its eos id; generated ids are decoded with special tokens skipped (`hf`'s
`tok_decode`). `EvalTokenizer` reproduces exactly that, with the same transformers
tokenizer when the folder has a `tokenizer_config.json` (for `tiny`: the one packaged with the
DSv4 tokenizer); a folder with only `tokenizer.json` is read with `tokenizers`, the prefix
being the model's bos (config.json's `bos_token_id`). No torch.
"""

from __future__ import annotations

import os

from dsv4batch.model.tokenizer import (bos_token_id, load_tokenizer, packaged_tokenizer_path,
                                       tokenizer_source)

TOKENIZER_CONFIG = "tokenizer_config.json"


def tokenizer_folder(model: str) -> str:
    """Where the tokenizer files of `model` (a checkpoint folder or `tiny`) are."""
    return tokenizer_source(model) or os.path.dirname(packaged_tokenizer_path())


class EvalTokenizer:
    """`encode` / `decode` / `prefix_token_id` / `eot_token_id` as lm-eval's `hf` backend has
    them for `model`; `add_bos_token` and `prefix_token_id` are the `hf` model arguments."""

    def __init__(self, model: str, add_bos_token: bool | None = None,
                 prefix_token_id: int | None = None):
        folder = tokenizer_folder(model)
        self.add_bos_token, self.custom_prefix = add_bos_token, prefix_token_id
        if os.path.isfile(os.path.join(folder, TOKENIZER_CONFIG)):
            from transformers import AutoTokenizer

            self.hf = AutoTokenizer.from_pretrained(folder)
            self.raw = None
            self.bos_id, self.eos_id = self.hf.bos_token_id, self.hf.eos_token_id
        else:
            self.hf, self.raw = None, load_tokenizer(folder)
            self.bos_id, self.eos_id = bos_token_id(model), None
        self.name = folder

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context (or the first rolling window) is conditioned on."""
        for candidate in (self.custom_prefix, self.bos_id, self.eos_id):
            if candidate is not None:
                return int(candidate)
        raise ValueError(f"tokenizer in {self.name!r} has no bos or eos token: pass "
                         "prefix_token_id=<id> in --model-args")

    @property
    def eot_token_id(self) -> int:
        return int(self.eos_id) if self.eos_id is not None else self.prefix_token_id

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of `ids`; `skip_special_tokens` as `hf`'s `tok_decode` for generations."""
        if self.hf is not None:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.raw.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of `text` (`hf`'s `tok_encode`: see the module doc)."""
        flag = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        if add_special_tokens is None and text.startswith(self.decode([self.prefix_token_id])):
            flag = False
        if self.hf is not None:
            kw = {} if flag is None else {"add_special_tokens": flag}
            return list(self.hf.encode(text, **kw))
        return self.raw.encode(text, add_special_tokens=True if flag is None else flag).ids
