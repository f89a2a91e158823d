"""Fixtures shared by every test folder: the transformers-saved checkpoint, its engine, and one
local Ray per test module. Also switches Triton's interpreter on where there is no GPU."""

import os

import pytest
import torch

# Triton decides compiled vs interpreted when a @triton.jit function is *defined*, triton's own
# (triton.language) included, and importing transformers' models or dsv4batch.kernels imports
# triton: so TRITON_INTERPRET=1 has to be set before any test module is collected, for
# tests/kernels/test_triton.py to run the kernels on the CPU. With CUDA they run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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


@pytest.fixture(scope="module")
def local_ray(request):
    """One local Ray for the test module (never another module's); its GCS address.

    A module that sets `RAY_DASHBOARD = True` gets the dashboard (on 127.0.0.1), which
    `ray.util.state` needs."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    dashboard = getattr(request.module, "RAY_DASHBOARD", False)
    ray.init(address="local", num_cpus=2, include_dashboard=dashboard, dashboard_host="127.0.0.1",
             logging_level="WARNING")
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
