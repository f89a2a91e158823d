"""Test helpers for the CPU kernels' builds: every ISA this CPU runs, and a build that failed."""

import pytest

from dsv4batch.kernels import build, cpu

# every build this CPU can run (avx512 and avx2 on an AVX-512 machine, avx2 here, generic always)
RUNNABLE = build.runnable_isas()


@pytest.fixture(params=RUNNABLE)
def isa(request):
    """Runs the test on each ISA's build (built here: CI has a compiler, so a build that fails
    fails the test instead of skipping it); the ISA in use before comes back after."""
    before = cpu.isa()
    cpu.use_isa(request.param)
    try:
        assert cpu.available(), cpu.build_error()
        yield request.param
    finally:
        cpu.use_isa(before)


def fail_build(monkeypatch, reason: str = "RuntimeError: no C++ compiler") -> None:
    """Makes this process's ISA look as if its kernels could not be built (`reason`)."""
    monkeypatch.setitem(build._state, cpu.isa(), reason)
