"""transformers' DeepseekV4ForCausalLM as the benchmarks' baseline, timed in a process of its own.

Why a process of its own: our `Engine` sets the process's glibc heap to keep freed memory
(`model/heap.py`), and that setting is process-wide. In our process transformers' per-call
[T, 129,280] logits (264 MB at 511 tokens, 1 GB at 2,047) stop page-faulting, which no user of
transformers gets, and its big frees left our engine's next call slower. Measured on a 2-core AMD
EPYC, tiny, one 511-token request, engines interleaved: transformers 0.23 s in our process vs
0.38-0.50 s in its own (default malloc); ours 0.28 s vs 0.19-0.24 s. `BaselineProcess` starts
`python -m bench._transformers CHECKPOINT` (it imports no dsv4batch engine code, so glibc keeps its
defaults) and sends it one batch at a time; the child times `hf_score` and answers in seconds, so
the two engines still alternate on the same machine (noise hits both alike).
`BaselineProcess(..., is_shared=True)` runs the same model in this process instead (the old way,
kept for comparison).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

from bench.common import best_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def twin_checkpoint(model) -> str:
    """A checkpoint folder of our `DSv4Model` that transformers loads (same weights)."""
    from dsv4batch.model.loader import save_checkpoint

    path = tempfile.mkdtemp(prefix="dsv4batch-bench-")
    save_checkpoint(model, path)
    return path


def load_twin(path: str):
    """transformers' DeepseekV4ForCausalLM (fp32, eager) from `twin_checkpoint`'s folder."""
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_score(hf, batch, head: bool = True):
    """transformers' cost of scoring `batch` (lists of token ids): one request at a time (no padding
    waste, its best case), full-vocabulary log-softmax; head=False: the decoder stack alone."""
    with torch.no_grad():
        for ids in batch:
            x = torch.tensor([ids])
            if not head:  # the decoder stack only (DeepseekV4Model), no vocabulary projection
                hf.model(input_ids=x, use_cache=False)
                continue
            logits = hf(input_ids=x, use_cache=False).logits[0, :-1].float()
            logits.log_softmax(-1).gather(1, x[0, 1:, None])


def hf_generate(hf, batch, new_tokens: int):
    """transformers' greedy `generate` of `new_tokens` tokens per request, one request at a time
    (it refuses left padding for DSv4, so that is how a transformers user batches)."""
    with torch.no_grad():
        for ids in batch:
            hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                        pad_token_id=0)


class BaselineProcess:
    """`seconds(batch, head)`: one timed `hf_score` call of transformers on the checkpoint folder
    `path` (`twin_checkpoint`'s), in a child process (default) or in this one (is_shared).
    `close()` (or a `with` block) ends it and removes the folder."""

    def __init__(self, path: str, is_shared: bool = False):
        self.path, self.hf, self.child = path, None, None
        if is_shared:
            self.hf = load_twin(path)
            return
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        self.child = subprocess.Popen([sys.executable, "-m", "bench._transformers", path], cwd=ROOT, env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._ask({"batch": [[0, 1]], "head": True})  # loaded and warm

    def seconds(self, batch, head: bool = True) -> float:
        if self.hf is not None:
            return best_of(lambda: hf_score(self.hf, batch, head), 1)
        return self._ask({"batch": batch, "head": head})

    def generate_seconds(self, batch, new_tokens: int) -> float:
        if self.hf is not None:
            return best_of(lambda: hf_generate(self.hf, batch, new_tokens), 1)
        return self._ask({"batch": batch, "generate": new_tokens})

    def _ask(self, request: dict) -> float:
        self.child.stdin.write(json.dumps(request) + "\n")
        self.child.stdin.flush()
        line = self.child.stdout.readline()
        if not line:
            raise RuntimeError(f"the transformers process ended (exit code {self.child.wait()})")
        return float(json.loads(line)["seconds"])

    def close(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.stdin.close()
            self.child.wait(timeout=60)
        self.hf = self.child = None
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve(path: str) -> None:
    """The child: load the twin, then answer each stdin line {"batch", "head"} (scoring) or
    {"batch", "generate": new tokens} with {"seconds"}."""
    hf = load_twin(path)
    for line in sys.stdin:
        request = json.loads(line)
        if "generate" in request:
            seconds = best_of(lambda: hf_generate(hf, request["batch"], request["generate"]), 1)
        else:
            seconds = best_of(lambda: hf_score(hf, request["batch"], request["head"]), 1)
        print(json.dumps({"seconds": seconds}), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1])
