"""Fixtures shared by every test folder (the transformers-saved checkpoint, its engine, the
session's Ray), the C++ kernels built once, and the test tiers. Also switches Triton's
interpreter on where there is no GPU.

Tiers: `slow` marks the end-to-end tests, set here from what a test is, never by hand: those in
`SLOW_FOLDERS` (tests/jobs: the CLI's jobs; tests/eval: lm-eval's evaluator and model), and any
that uses a Ray cluster (a fixture in `RAY_FIXTURES`, directly or through another fixture) or
starts another Python process (`PROCESS_FIXTURES`: the CLI, an import or memory probe).
`make test-fast` runs `-m "not slow"`: the unit tier (kernels, model, planner, pipeline steps
in-process); `make test` runs everything. A fast test that starts Ray by itself fails
(`no_ray_start_in_the_fast_tier`).
"""

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Triton decides compiled vs interpreted when a @triton.jit function is *defined*, triton's own
# (triton.language) included, and importing transformers' models or dsv4batch.kernels imports
# triton: so TRITON_INTERPRET=1 has to be set before any test module is collected, for
# tests/kernels/test_triton.py to run the kernels on the CPU. With CUDA they run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TESTS = Path(__file__).parent
SLOW_FOLDERS = {"jobs", "eval"}
# the session's clusters: tests/jobs/conftest.py has the multi-node one
RAY_FIXTURES = {"ray_head", "local_ray", "gpu_cluster", "job_head"}
# another Python process: the CLI as a user runs it, or a probe that needs a fresh interpreter
PROCESS_FIXTURES = {"run_cli", "run_python"}


def pytest_configure(config):
    """Token authentication, with one fresh token, for every Ray this session starts or joins:
    heads, drivers in this process and CLI subprocesses all inherit it from the environment.
    (Ray turns tokens on for a new local cluster, or a head when ~/.ray/auth_token exists, but
    never for a driver joining an explicit address: left to itself, a head and its drivers can
    disagree.) Set before anything imports ray, which reads the mode once."""
    if "RAY_AUTH_MODE" not in os.environ:
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    import torch

    from tests.threads import MACHINE  # noqa: F401 - read before the count changes

    torch.set_num_threads(1)  # why: tests/threads.py


def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = Path(str(item.path)).relative_to(TESTS).parts[0]
        if folder in SLOW_FOLDERS or (RAY_FIXTURES | PROCESS_FIXTURES) & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def no_ray_start_in_the_fast_tier(request):
    """A test outside the slow tier must not start Ray itself (it would slow the inner loop and
    be marked by nothing)."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    import ray

    before = ray.is_initialized()
    yield
    assert before or not ray.is_initialized(), "this test started Ray: use the local_ray fixture"


@pytest.fixture(scope="session", autouse=True)
def kernels_built():
    """Build the C++ kernels once, in this process, before any test or Ray worker needs them:
    on a fresh machine several actors would otherwise compile them at once, inside timed tests.
    (Cached by source and CPU in ~/.cache/dsv4batch/kernels: a no-op after the first build.)"""
    from dsv4batch.kernels import cpu

    cpu.available()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """A transformers save_pretrained DSv4 checkpoint with the real tokenizer's vocabulary."""
    from tests.model_factory import make_hf_checkpoint

    path = tmp_path_factory.mktemp("ckpt")
    make_hf_checkpoint(str(path), seed=0, vocab_size=129280)
    return str(path)


@pytest.fixture(scope="session")
def engine(checkpoint):
    """`Engine` over `checkpoint` (fp32, CPU, default engine settings): the reference scores."""
    from dsv4batch.model import Engine

    return Engine.from_pretrained(checkpoint)


@pytest.fixture(scope="session")
def ray_head():
    """One local Ray head for the whole session (`ray start --head`: 2 CPUs, no GPU, the
    dashboard on 127.0.0.1, which `ray.util.state` needs); its GCS address. Every module that
    needs a local Ray joins it, CLI drivers in subprocesses too (`--ray-address`), instead of
    starting one each."""
    from tests.ray_head import leave, ray_head as start

    with start(dict(os.environ)) as (address, _):
        yield address
        leave(address)


@pytest.fixture(scope="module")
def local_ray(ray_head):
    """This process joined to the session's Ray head (a module after a multi-node one joins it
    again); its GCS address. Nothing is torn down here: the head lives for the session."""
    from tests.ray_head import join

    join(ray_head)
    return ray_head


def _python(args: list, **options) -> subprocess.CompletedProcess:
    options = {"capture_output": True, "text": True, "timeout": 300, **options}
    return subprocess.run([sys.executable, *map(str, args)], **options)


@pytest.fixture
def run_cli():
    """`python -m dsv4batch.jobs.score ARGV...` in a fresh interpreter, what a user's shell
    runs: `run_cli(*argv, **subprocess.run options)` -> CompletedProcess (text, captured)."""
    return lambda *argv, **options: _python(["-m", "dsv4batch.jobs.score", *argv], **options)


@pytest.fixture
def run_python():
    """`python -c CODE ARGS...` in a fresh interpreter, for what this process cannot show (which
    modules an import pulls in, a peak RSS): `run_python(code, *args, **subprocess.run
    options)` -> CompletedProcess (text, captured; `check=True` to fail on a non-zero exit)."""
    return lambda code, *args, **options: _python(["-c", code, *args], **options)


@pytest.fixture
def kernels():
    """set(**fields): the active `KernelConfig` with `fields` replaced, for the rest of the test
    (what `monkeypatch.setenv` did for the old environment switches); engines made afterwards
    keep it (`Engine.kernels`)."""
    from contextlib import ExitStack

    from dsv4batch.kernels import use_kernels

    with ExitStack() as stack:
        yield lambda **fields: stack.enter_context(use_kernels(**fields))
