"""`dsv4batch eval` against lm-eval's own `hf` backend on one transformers-saved checkpoint:
the same metrics and per-sample log-likelihoods (multiple choice, greedy flags, rolling
perplexity with documents longer than max_length), in this process and through Ray Data."""

import glob
import json
import math
import os

import pytest

from dsv4batch.jobs.score import main
from tests.eval.tasks import hf_folder, greedy_docs, write_tasks
from tests.ties import ambiguous_greedy, near

MAX_LENGTH = 24  # tokens per request: the long tiny_ppl document needs several windows


@pytest.fixture(scope="module")
def setup(tmp_path_factory, checkpoint):
    """(model folder, task folder, task names, lm-eval's hf results with samples)."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    tmp = tmp_path_factory.mktemp("eval")
    folder = hf_folder(checkpoint, tmp / "model")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32").eval()
    names = write_tasks(tmp / "tasks", greedy_docs(model, AutoTokenizer.from_pretrained(folder)))
    hf = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={folder},dtype=float32,max_length={MAX_LENGTH}",
        tasks=names, device="cpu", batch_size=4, log_samples=True,
        task_manager=TaskManager(include_path=str(tmp / "tasks")))
    return folder, str(tmp / "tasks"), names, hf


def run_eval(setup, out, *flags):
    folder, tasks, names, _ = setup
    code = main(["eval", "--model", folder, "--tasks", ",".join(names), "--include-path", tasks,
                 "--max-length", str(MAX_LENGTH), "--output-path", str(out), "--log-samples",
                 "--batch-size", "8", *flags])
    assert code == 0
    [results] = glob.glob(f"{out}/**/results_*.json", recursive=True)
    with open(results) as f:
        doc = json.load(f)
    samples = {}
    for name in names:
        [path] = glob.glob(f"{out}/**/samples_{name}_*.jsonl", recursive=True)
        with open(path) as f:
            samples[name] = sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])
    return doc, samples


def responses(sample) -> list:
    """[(loglikelihood, is_greedy)] or [(loglikelihood,)] per request of one logged sample (a
    samples file holds the values as strings)."""
    out = []
    for (r,) in sample["resps"]:
        r = tuple(r) if isinstance(r, (list, tuple)) else (r,)
        out.append((float(r[0]), *(v in (True, "True") for v in r[1:])))
    return out


def check_agreement(setup, ours, samples, near_tie):
    """The same requests and log-likelihoods (1e-4); greedy flags and accuracies exactly, except
    where a near-tie leaves them to rounding (ours and transformers' round apart): a flag may
    differ only at a request `near_tie` says is tied at the top, an accuracy only by the
    documents that hold such a request or whose two best choices are near-tied."""
    hf = setup[3]
    for name in setup[2]:
        theirs = hf["results"][name]
        mine = ours["results"][name]
        hf_samples = sorted(hf["samples"][name], key=lambda s: s["doc_id"])
        assert len(samples[name]) == len(hf_samples) > 0
        unsure = 0  # documents whose accuracy rounding may decide
        for a, b in zip(samples[name], hf_samples, strict=True):
            args = [list(v.values()) for v in a["arguments"].values()]  # the file's layout
            assert args == json.loads(json.dumps(b["arguments"]))  # the same requests
            flipped = False
            for req, ra, rb in zip(args, responses(a), responses(b), strict=True):
                assert ra[0] == pytest.approx(rb[0], abs=1e-4, rel=1e-4), (name, a["doc_id"])
                if ra[1:] != tuple(rb[1:]):  # is_greedy
                    assert near_tie(*req), (name, a["doc_id"], req)
                    flipped = True
            unsure += flipped or choices_near_tied(b, args)
        for metric in ("acc,none", "acc_norm,none"):
            if metric in theirs:
                assert abs(mine[metric] - theirs[metric]) <= unsure / len(hf_samples), (name, metric)
                assert unsure or mine[metric] == theirs[metric], (name, metric)
        for metric in ("perplexity,none", "word_perplexity,none", "byte_perplexity,none",
                       "bits_per_byte,none"):
            if metric in theirs:
                assert mine[metric] == pytest.approx(theirs[metric], rel=1e-4), (name, metric)


def choices_near_tied(sample, reqs: list, tol: float = 1e-4) -> bool:
    """A multiple-choice sample (its requests `reqs`: [context, continuation] each) whose two
    likeliest choices (raw or per character, as acc and acc_norm rank them) are within rounding
    of each other."""
    lls = [r[0] for r in responses(sample)]
    if len(lls) < 2:
        return False
    for scores in (lls, [ll / len(req[1]) for ll, req in zip(lls, reqs)]):
        top = sorted(scores, reverse=True)[:2]
        if near(top[0], top[1], tol, tol):
            return True
    return False


@pytest.fixture(scope="module")
def near_tie(setup, engine):
    """near_tie(context, continuation): could rounding decide this loglikelihood request's greedy
    flag, i.e. is a continuation token near-tied with another at the top (our engine's
    log-probs, the 1e-4 the log-likelihoods are compared to)?"""
    from dsv4batch.eval import DSv4LM

    made = {}  # the backend's tokenization, loaded at the first flag that differs

    def check(context: str, continuation: str) -> bool:
        lm = made.get("lm") or made.setdefault("lm", DSv4LM(pretrained=setup[0], max_length=MAX_LENGTH))
        if context:
            ctx, cont = lm._encode_pair(context, continuation)
        else:  # lm-eval's TemplateLM.loglikelihood: an empty context is the prefix token
            ctx, cont = [lm.prefix_token_id], lm.tok_encode(continuation, add_special_tokens=False)
        ids = (ctx + cont)[-(MAX_LENGTH + 1):]
        [d], _ = engine.score_details([ids], top_k=2)
        n = len(cont)
        return bool(ambiguous_greedy(d.logprobs[-n:], d.top_logprobs[-n:], 1e-4, 1e-4).any())
    return check


def test_eval_matches_lm_eval_hf(setup, tmp_path, capsys, near_tie):
    ours, samples = run_eval(setup, tmp_path / "out")
    check_agreement(setup, ours, samples, near_tie)
    hf = setup[3]
    assert 0 < hf["results"]["tiny_greedy"]["acc,none"] < 1  # some continuations are greedy
    from dsv4batch.eval.tokens import EvalTokenizer

    long_doc = EvalTokenizer(setup[0]).encode(samples["tiny_ppl"][-1]["doc"]["text"])
    assert len(long_doc) > 3 * MAX_LENGTH  # scored in several rolling windows
    table = capsys.readouterr().out
    assert "tiny_mc" in table and "acc_norm" in table and "word_perplexity" in table
    assert ours["config"]["model"] == "dsv4batch"
    assert math.isfinite(ours["results"]["tiny_ppl"]["word_perplexity,none"])


@pytest.mark.usefixtures("local_ray")
def test_eval_through_ray_data_matches_too(setup, tmp_path, local_ray, near_tie):
    ours, samples = run_eval(setup, tmp_path / "out", "--ray-address", local_ray,
                             "--model-args", "cpus_per_replica=0.5,torch_threads=1")
    check_agreement(setup, ours, samples, near_tie)
