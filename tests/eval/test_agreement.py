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


def check_agreement(setup, ours, samples):
    hf = setup[3]
    for name in setup[2]:
        theirs = hf["results"][name]
        mine = ours["results"][name]
        for metric in ("acc,none", "acc_norm,none"):
            if metric in theirs:
                assert mine[metric] == theirs[metric], (name, metric)
        for metric in ("perplexity,none", "word_perplexity,none", "byte_perplexity,none",
                       "bits_per_byte,none"):
            if metric in theirs:
                assert mine[metric] == pytest.approx(theirs[metric], rel=1e-4), (name, metric)
        hf_samples = sorted(hf["samples"][name], key=lambda s: s["doc_id"])
        assert len(samples[name]) == len(hf_samples) > 0
        for a, b in zip(samples[name], hf_samples, strict=True):
            args = [list(v.values()) for v in a["arguments"].values()]  # the file's layout
            assert args == json.loads(json.dumps(b["arguments"]))  # the same requests
            for ra, rb in zip(responses(a), responses(b), strict=True):
                assert ra[0] == pytest.approx(rb[0], abs=1e-4, rel=1e-4), (name, a["doc_id"])
                assert ra[1:] == tuple(rb[1:]), (name, a["doc_id"])  # is_greedy


def test_eval_matches_lm_eval_hf(setup, tmp_path, capsys):
    ours, samples = run_eval(setup, tmp_path / "out")
    check_agreement(setup, ours, samples)
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
def test_eval_through_ray_data_matches_too(setup, tmp_path, local_ray):
    ours, samples = run_eval(setup, tmp_path / "out", "--ray-address", local_ray,
                             "--model-args", "cpus_per_replica=0.5")
    check_agreement(setup, ours, samples)
