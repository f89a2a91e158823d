"""`DSv4LM`: the lm-evaluation-harness model "dsv4batch" (lm-eval 0.4.13's `TemplateLM`).

    lm_eval.simple_evaluate(model="dsv4batch", model_args="pretrained=PATH,max_length=2047", ...)

Requests are tokenized as lm-eval's `hf` backend tokenizes them on the same folder
(`tokens.EvalTokenizer`, and `TemplateLM`'s own context/continuation split), truncated on the
left to `max_length + 1` ids as `hf` does, and scored in batches (`scorer`): in this process,
or with `replicas` / `ray_address` through the Ray Data scoring stage of `dsv4batch score`.

- `loglikelihood` -> [(log p(continuation | context), every continuation token the argmax)]
- `loglikelihood_rolling` -> [log p(document)]: lm-eval's own rolling windows
  (`utils.get_rolling_token_windows` + `make_disjoint_window`, context_len 1, windows of
  `max_length` predictions), summed per document; all windows of all documents are scored
  together.
- `generate_until` -> [text]: lm-eval's vllm backend's semantics (`generation`: until + the EOS
  string, max_gen_toks, greedy or seeded sampling, the context cut on the left to
  `max_length - max_gen_toks`, the text cut at every stop string); requests grouped by
  gen_kwargs, `batch_size` at a time into `Engine.generate` (continuous batching, no padding:
  lm-eval's `hf` backend left-pads, which DSv4's compressed caches cannot take) or, on Ray,
  through the generation stage of `dsv4batch generate`.
- `apply_chat_template` (lm-eval's --apply_chat_template): our DSv4 chat encoding
  (`model.chat.render`; V4 has no Jinja template), chat mode unless `thinking`.

Model arguments: `pretrained` (a checkpoint folder or `tiny`), `dtype`, `max_length` (tokens the
model sees per request, `hf`'s meaning; default `max_model_len - 1`) or `max_model_len`,
`max_batched_tokens`, `add_bos_token`, `prefix_token_id`, `max_gen_toks` (default 256), `seed`
(of sampled generations; default 1234, vllm's), `thinking` (DSv4 thinking mode under
--apply_chat_template: the answer is what follows `</think>`), `replicas`, `tp` (ranks per
replica, on Ray), `ray_address`, `gpus_per_replica`, `cpus_per_replica`, `planner`,
`prefill_chunk_size`, `head_precision`; lm-eval's `batch_size` is the requests per engine call
(per actor batch on Ray), `device` picks cpu.
"""

from __future__ import annotations

import logging

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from dsv4batch.eval import generation
from dsv4batch.eval.scorer import make_scorer
from dsv4batch.eval.tokens import EvalTokenizer
from dsv4batch.jobspec.config import ScoreConfig
from dsv4batch.model import chat

log = logging.getLogger(__name__)

DEFAULT_BATCH = 64
ENGINE_ARGS = ("dtype", "max_batched_tokens", "replicas", "tp", "ray_address", "gpus_per_replica",
               "cpus_per_replica", "planner", "prefill_chunk_size", "torch_threads", "head_precision")
DEFAULT_SEED = 1234  # lm-eval's vllm backend's


@register_model("dsv4batch")
class DSv4LM(TemplateLM):
    """lm-eval `LM` over the dsv4batch engine; see the module doc for the model arguments."""

    backend = "causal"

    def __init__(self, pretrained: str = "tiny", model: str | None = None,
                 max_length: int | None = None, max_model_len: int | None = None,
                 add_bos_token: bool | None = None, prefix_token_id: int | None = None,
                 max_gen_toks: int = generation.DEFAULT_MAX_GEN_TOKS, seed: int = DEFAULT_SEED,
                 thinking: bool = False, batch_size: int | str | None = None,
                 max_batch_size: int | None = None, device: str | None = None,
                 progress: bool = False, **engine_args):
        super().__init__()
        unknown = sorted(set(engine_args) - set(ENGINE_ARGS))
        if unknown:
            raise ValueError(f"dsv4batch: unknown model argument(s) {unknown}; known: "
                             f"pretrained, max_length, max_model_len, add_bos_token, "
                             f"prefix_token_id, max_gen_toks, seed, thinking, "
                             f"{', '.join(ENGINE_ARGS)}")
        path = model or pretrained
        if max_length is not None:
            max_model_len = int(max_length) + 1  # hf's max_length inputs + the last target
        fields = dict(model=path, batch_size=_batch_size(batch_size), progress=bool(progress),
                      **({"max_model_len": int(max_model_len)} if max_model_len else {}),
                      **engine_args)
        self.config = ScoreConfig.from_dict(fields)
        self.tokenizer = EvalTokenizer(path, add_bos_token, prefix_token_id)
        self.scorer = make_scorer(self.config, device)
        self.max_gen_toks, self.seed, self.thinking = int(max_gen_toks), int(seed), bool(thinking)
        self._truncated = 0

    # -- what lm-eval asks of a TemplateLM ------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eot_token_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.prefix_token_id

    @property
    def max_length(self) -> int:
        """Tokens the model sees per request (a request is at most max_length + 1 ids)."""
        return self.config.max_model_len - 1

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens)

    def tok_decode(self, tokens, skip_special_tokens: bool = False, **kwargs) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict],
                            add_generation_prompt: bool = True) -> str:
        """lm-eval's few-shot conversation as DSv4 prompt text (`model.chat.render`): the
        assistant's turn opened after it, or, without `add_generation_prompt`, its last
        assistant message left open for the model to continue (lm-eval's gen_prefix: the
        `hf` backend's continue_final_message). `chat.ChatError` for a malformed conversation."""
        last_is_reply = bool(chat_history) and chat_history[-1].get("role") == "assistant"
        text = chat.render(chat_history, self.thinking, add_generation_prompt)
        if not add_generation_prompt and last_is_reply:
            text = text.removesuffix(chat.EOS)
        return text

    def chat_template(self, chat_template: bool | str = False) -> str:
        """What lm-eval logs (and hashes) as the chat template: the encoder's name and mode,
        V4 having no Jinja template."""
        return f"dsv4batch.model.chat ({'thinking' if self.thinking else 'chat'} mode)"

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              **kwargs) -> list[tuple[float, bool]]:
        """requests: [(request args or None, context ids, continuation ids)] -> [(logprob,
        is_greedy)]; context + continuation is cut on the left to max_length + 1 ids."""
        limit, batch = self.max_length + 1, []
        for _, context, continuation in requests:
            if not context or not continuation:
                raise ValueError("a loglikelihood request needs context and continuation ids")
            if len(continuation) > self.max_length:
                raise ValueError(f"continuation of {len(continuation)} tokens is longer than "
                                 f"max_length={self.max_length}")
            ids = [*context, *continuation]
            if len(ids) > limit:
                self._truncated += 1
                if self._truncated == 1:
                    log.warning("context + continuation of %d tokens exceeds max_length=%d: "
                                "truncating from the left (as lm-eval's hf backend does)",
                                len(ids), self.max_length)
            batch.append((ids[-limit:], len(continuation)))
        answers = self.scorer.score(batch)
        for (args, _, _), answer in zip(requests, answers):
            if args is not None:
                self.cache_hook.add_partial("loglikelihood", args, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """[log p(document)] per request (`Instance.args == (text,)`), rolling windows."""
        windows, owner = [], []
        for doc, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window,
                                             lm_utils.get_rolling_token_windows(
                                                 token_list=self.tok_encode(text),
                                                 prefix_token=self.prefix_token_id,
                                                 max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(doc)
        totals = [0.0] * len(requests)
        for doc, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[doc] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """[generated text] per request (`Instance.args == (context, gen_kwargs)`), in order;
        see `generation` for the semantics. Each answer goes to lm-eval's cache hook."""
        args = [tuple(req.args) for req in requests]
        plans = generation.plan_requests(
            args, self._encode_context, eos=self.tok_decode([self.eot_token_id]),
            max_length=self.max_length, default_max_gen_toks=self.max_gen_toks, seed=self.seed,
            thinking=self.thinking)
        texts: list = [None] * len(requests)
        # Ray Data cuts a call's requests into actor batches itself: one call per group there
        size = len(requests) if self.scorer.splits_batches else self.config.batch_size
        for batch in generation.batches(args, plans, max(1, size)):
            answers = self.scorer.generate([(plans[i].ids, plans[i].params) for i in batch])
            for i, answer in zip(batch, answers):
                text = self.tok_decode(answer.token_ids, skip_special_tokens=True)
                texts[i] = generation.finish_text(text, plans[i].until, self.thinking)
                self.cache_hook.add_partial("generate_until", args[i], texts[i])
        return texts

    def _encode_context(self, context: str) -> list[int]:
        """A generation context's ids (`tok_encode`); an empty one is the prefix token, as an
        empty loglikelihood context is (the engine cannot start from nothing)."""
        return self.tok_encode(context) or [self.prefix_token_id]

    def close(self) -> None:
        self.scorer.close()


def _batch_size(value) -> int:
    """lm-eval's batch_size (an int, 'auto', 'auto:N' or None) -> requests per engine call."""
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return DEFAULT_BATCH
    return int(value)
