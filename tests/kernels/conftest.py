"""The C++ kernels split their rows by torch's thread count: their tests run with the machine's
thread count, as an engine does, not the session's one (tests/threads.py)."""

import pytest

from tests.threads import MACHINE, torch_threads


@pytest.fixture(autouse=True)
def machine_threads():
    with torch_threads(MACHINE):
        yield
