"""The "dsv4batch" lm-eval model on its own: registration, hf-compatible tokenization, batched
scoring that equals the engine's, rolling windows, truncation, generate_until refused."""


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


def test_generate_until_is_refused_and_bad_arguments_named(lm, folder):
    from dsv4batch.eval import DSv4LM

    with pytest.raises(NotImplementedError, match="does not generate: generate_until .*: t\\)"):
        lm.generate_until([Req("Say hi", {"until": ["\n"]})])
    with pytest.raises(ValueError, match=r"unknown model argument\(s\) \['temperature'\]"):
        DSv4LM(pretrained=folder, temperature=0.5)
    assert np.isfinite(lm.loglikelihood([Req("a", " b")])[0][0])
