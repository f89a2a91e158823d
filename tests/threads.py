"""torch's intra-op threads in the test process.

The session runs torch on one thread (tests/conftest.py): the tests check values, not speed, and
on a 2-core machine shared with other jobs two threads' barrier waits cost more than they give
(tests/model/test_plans.py: 86 s on 2 threads, 5.5 s on 1, one loaded 2-core EPYC). Tests about
threads set them explicitly with `torch_threads`; `MACHINE` is torch's own default here.
"""

from __future__ import annotations

import contextlib

import torch

MACHINE = torch.get_num_threads()  # read at import, before the session sets 1


@contextlib.contextmanager
def torch_threads(n: int):
    """torch.set_num_threads(n) inside the block, the count before it after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
