"""The "dsv4batch" lm-eval model on its own: registration, hf-compatible tokenization, batched
scoring that equals the engine's, rolling windows, truncation; generate_until (lm-eval's
gen_kwargs, the engine's tokens cut at the stops, seeded sampling) and the chat template."""


import numpy as np
import pytest

from tests.eval.tasks import hf_folder


def test_import_dsv4batch_does_not_import_lm_eval_and_eval_registers(run_python):
    code = ("import sys, dsv4batch, dsv4batch.pipeline, dsv4batch.jobs.score; "
            "print(sorted(m for m in ('lm_eval', 'torch') if m in sys.modules)); "
            "import dsv4batch.eval, lm_eval.api.registry as r; "
            "print(r.get_model('dsv4batch').__name__)")
    out = run_python(code, check=True)
    assert out.stdout.split() == ["[]", "DSv4LM"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, checkpoint):
    return hf_folder(checkpoint, tmp_path_factory.mktemp("lm") / "model")


@pytest.fixture(scope="module")
def lm(folder):
    from dsv4batch.eval import DSv4LM

    return DSv4LM(pretrained=folder, max_length=12, batch_size=3, device="cpu")


class Req:
    """The part of lm-eval's `Instance` a model reads."""

    def __init__(self, *args, task_name="t"):
        self.args, self.task_name = args, task_name


def test_tokenization_is_hf_backends(folder, lm):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    for text in ("Hello world", " leading space", "<｜begin▁of▁sentence｜>already has bos"):
        assert lm.tok_encode(text) == hf.encode(text, **(
            {"add_special_tokens": False} if text.startswith(hf.bos_token) else {}))
    assert lm.prefix_token_id == hf.bos_token_id == 0 and lm.max_length == 12
    context, continuation = lm._encode_pair("Question: why? ", "Because.")
    whole = hf.encode("Question: why? Because.")
    assert context == hf.encode("Question: why?") and context + continuation == whole


def test_loglikelihood_is_the_engines_batched_and_greedy_flags(lm, engine):
    reqs = [Req("The capital of France is", " Paris"), Req("", "Hello there"),
            Req("One two", " three four five"), Req("The capital of France is", " Paris")]
    got = lm.loglikelihood(reqs)
    stats = lm.scorer.stats
    assert stats["requests"] == 4 and stats["scored_requests"] == 3  # the repeat scored once
    for req, (logprob, greedy) in zip(reqs, got):
        context, continuation = req.args
        if context:
            ctx, cont = lm._encode_pair(context, continuation)
        else:  # an empty context is the prefix token (lm-eval's TemplateLM.loglikelihood)
            ctx, cont = [lm.prefix_token_id], lm.tok_encode(continuation, add_special_tokens=False)
        [ref], _ = engine.score_details([ctx + cont])
        assert logprob == pytest.approx(float(ref.logprobs[-len(cont):].sum()), abs=1e-4)
        assert greedy == bool(ref.is_greedy[-len(cont):].all())


def test_rolling_windows_cover_every_token_once(lm, engine):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    text = " ".join(f"word{i}" for i in range(30))
    tokens = lm.tok_encode(text)
    assert len(tokens) > 2 * lm.max_length
    [total] = lm.loglikelihood_rolling([Req(text)])
    expected = 0.0
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
        tokens, lm.prefix_token_id, lm.max_length, 1)]
    assert sum(len(c) for _, c in windows) == len(tokens)
    for ctx, cont in windows:
        ids = (ctx + cont)[-(lm.max_length + 1):]
        assert len(ids) <= lm.max_length + 1
        expected += float(engine.score_tokens([ids])[0][-len(cont):].sum())
    assert total == pytest.approx(expected, abs=1e-4)


def test_long_requests_are_cut_on_the_left_like_hf(lm, engine):
    context = " ".join(["filler"] * 40)
    [(logprob, _)] = lm.loglikelihood([Req(context, " end")])
    ctx, cont = lm._encode_pair(context, " end")
    ids = (ctx + cont)[-(lm.max_length + 1):]
    assert logprob == pytest.approx(float(engine.score_tokens([ids])[0][-len(cont):].sum()),
                                    abs=1e-4)


def test_bad_arguments_are_named(lm, folder):
    from dsv4batch.eval import DSv4LM

    with pytest.raises(ValueError, match=r"unknown model argument\(s\) \['temperature'\]"):
        DSv4LM(pretrained=folder, temperature=0.5)
    with pytest.raises(ValueError, match=r"generation argument\(s\) \['repetition_penalty'\]"):
        lm.generate_until([Req("Say hi", {"until": ["\n"], "repetition_penalty": 1.1})])
    with pytest.raises(ValueError, match="no room for the context in max_length=12"):
        lm.generate_until([Req("Say hi", {"max_gen_toks": 12})])
    assert np.isfinite(lm.loglikelihood([Req("a", " b")])[0][0])


EOS = "<｜end▁of▁sentence｜>"


def test_gen_kwargs_read_as_lm_evals_vllm_backend_reads_them():
    from dsv4batch.eval.generation import finish_text, parse_gen_kwargs, request_seed

    def parse(kwargs):
        return parse_gen_kwargs(kwargs, EOS, 256)

    assert parse({"until": "\n", "do_sample": False, "temperature": 0.7}) == (
        {"max_tokens": 256, "temperature": 0.0}, ["\n", EOS], 256)  # greedy: do_sample false
    assert parse({"until": ["Q:", EOS], "temperature": 0.5})[0]["temperature"] == 0.5  # samples
    assert parse({"do_sample": True})[0]["temperature"] == 1.0  # transformers' / vLLM's default
    assert parse({"max_new_tokens": 5, "top_p": 0.9, "top_k": 4}) == (
        {"max_tokens": 5, "temperature": 0.0, "top_p": 0.9, "top_k": 4}, [EOS], 5)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        parse({"do_sample": True, "temperature": -1.0})
    assert finish_text(" 42\n\nQuestion: next", ["Question:", "\n\n", EOS]) == " 42"
    assert finish_text("so 6 * 7</think> 42 Question: x", ["Question:"], thinking=True) == "42 "
    seeds = {request_seed(1234, "ctx", {"a": 1}, k) for k in range(3)}
    assert len(seeds) == 3 and request_seed(1234, "ctx", {"a": 1}, 0) in seeds


@pytest.fixture(scope="module")
def gen_lm(folder):
    from dsv4batch.eval import DSv4LM

    return DSv4LM(pretrained=folder, max_length=40, batch_size=3, device="cpu")


def engine_text(engine, lm, context: str, params) -> str:
    """What the engine generates for `context` as the backend must feed it, decoded as the `hf`
    backend decodes (special tokens skipped)."""
    room = lm.max_length - params.max_tokens
    [g], _ = engine.generate([lm.tok_encode(context)[-room:]], params)
    return lm.tok_decode(g.token_ids.tolist(), skip_special_tokens=True)


def test_greedy_generations_are_the_engines_cut_at_every_stop(gen_lm, engine):
    from dsv4batch.model.sampling import SamplingParams

    long = " ".join(f"item{i}" for i in range(40))  # more than max_length - max_gen_toks ids
    assert len(gen_lm.tok_encode(long)) > 40
    reqs = [Req("The capital of France is", {"until": ["\n"], "max_gen_toks": 8}),
            Req(long, {"until": [], "max_gen_toks": 6}),
            Req("One two", {"until": "Question:", "do_sample": False, "max_gen_toks": 8})]
    full = [engine_text(engine, gen_lm, context, SamplingParams(max_tokens=kw["max_gen_toks"]))
            for context, kw in (r.args for r in reqs)]
    # a stop string that the first generation contains: its text is cut right before it
    stop = full[0][len(full[0]) // 2:][:2]
    reqs.append(Req("The capital of France is", {"until": [stop], "max_gen_toks": 8}))
    cached = []
    gen_lm.set_cache_hook(type("Hook", (), {"add_partial": lambda self, *a: cached.append(a)})())
    got = gen_lm.generate_until(reqs)
    assert got[:3] == [t.split("\n")[0] if i == 0 else t for i, t in enumerate(full)]
    assert got[3] == full[0][:full[0].index(stop)] and len(got[3]) < len(full[0])
    expected = [("generate_until", r.args, t) for r, t in zip(reqs, got)]
    assert sorted(cached, key=repr) == sorted(expected, key=repr)  # cached in batch order


def test_sampled_generations_are_seeded_per_request(gen_lm):
    kwargs = {"until": [], "do_sample": True, "temperature": 1.0, "max_gen_toks": 6}
    reqs = [Req(c, kwargs) for c in ("Once upon a time", "Once upon a time", "A", "B b")]
    first = gen_lm.generate_until(reqs)
    assert first[0] != first[1]  # lm-eval's repeats: the same request samples afresh
    # another call, other batch-mates (reversed): the same texts; identical requests take
    # their seeds in the order they come, so the first "Once upon a time" still gets first[0]
    assert gen_lm.generate_until(reqs[::-1]) == [first[3], first[2], first[0], first[1]]


def test_chat_template_is_the_dsv4_encoding(gen_lm):
    from dsv4batch.model import chat

    convo = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "Question: 2+2?"}]
    text = gen_lm.apply_chat_template(convo)
    assert text == f"{chat.BOS}Be brief.{chat.USER}Question: 2+2?{chat.ASSISTANT}{chat.END_THINK}"
    ids = gen_lm.tok_encode(text)
    assert ids[0] == 0 and ids[1] != 0 and ids[-2:] == [128804, 128822]  # one bos, no extra
    # lm-eval's gen_prefix: the last assistant message is left open to continue
    prefixed = gen_lm.apply_chat_template([*convo, {"role": "assistant", "content": "Answer:"}],
                                          add_generation_prompt=False)
    assert prefixed == text + "Answer:"
    assert "chat mode" in gen_lm.chat_template(True) and gen_lm.tokenizer_name
