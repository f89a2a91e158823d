import pytest


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """A transformers save_pretrained DSv4 checkpoint with the real tokenizer's vocabulary."""
    from tests.model_factory import make_hf_checkpoint

    path = tmp_path_factory.mktemp("ckpt")
    make_hf_checkpoint(str(path), seed=0, vocab_size=129280)
    return str(path)
