"""Building the CPU kernels (`kernels/build.py`) and choosing them (`kernels/select.py`): the ISAs a
CPU runs, a failed build's reason and its one warning, several processes building one library at
a time, clang, and which kernels each ISA's default takes."""

import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from dsv4batch.kernels import build, cpu, select
from dsv4batch.model.head import PackedHead
from tests.kernels.isas import RUNNABLE, fail_build

V3 = set("avx avx2 bmi1 bmi2 f16c fma abm movbe xsave".split())


def test_the_isas_a_cpu_runs(monkeypatch):
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(build, "_cpu_flags", lambda: V3 | {"sse4_2"})
    assert build.runnable_isas() == ["avx2", "generic"] and build.native_isa() == "avx2"
    monkeypatch.setattr(build, "_cpu_flags", lambda: V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})
    assert build.runnable_isas() == ["avx512", "avx2", "generic"]
    monkeypatch.setattr(build, "_cpu_flags", lambda: V3 - {"fma"})  # no FMA: no x86-64-v3 code
    assert build.runnable_isas() == ["generic"]
    with pytest.raises(ValueError, match="cannot run avx2"):
        build.resolve("avx2")
    monkeypatch.setattr(build.platform, "machine", lambda: "arm64")
    assert build.resolve("native") == "generic"
    with pytest.raises(ValueError, match="ISA must be"):
        build.resolve("sse9")


def test_a_failed_build_warns_once_and_says_why(monkeypatch, tmp_path):
    bad = tmp_path / "bad-cxx"
    bad.write_text("#!/bin/sh\necho 'error: no such flag' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CXX", str(bad))
    monkeypatch.setenv(build.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_state", {k: v for k, v in build._state.items() if k != "generic"})  # (restored)
    with pytest.warns(RuntimeWarning, match="generic CPU kernels are not available.*no such flag"):
        assert not build.load("generic")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not build.load("generic")  # not retried, no second warning
    assert "no such flag" in build.build_error("generic")
    monkeypatch.setenv("CXX", str(tmp_path / "missing"))
    del build._state["generic"]
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        assert not build.load("generic")


def test_each_isa_takes_the_kernels_its_table_chose(monkeypatch):
    assert set(select.DEFAULTS) == set(build.ISA_FLAGS) and select.DEFAULTS["avx2"] == set(select.KERNELS)
    before = cpu.isa()
    try:
        for isa in RUNNABLE:
            cpu.use_isa(isa)
            chosen = select.selection()["kernels"]
            assert chosen == {k: "cpu" if k in select.DEFAULTS[isa] else "torch" for k in select.KERNELS}
            weight = torch.randn(300, 16)
            assert (PackedHead().panels(weight) is not None) == (chosen["head"] == "cpu")
            with select.force(head=False, elementwise=True):
                assert not select.chosen("head") and select.chosen("elementwise")
            assert select.chosen("head") == (chosen["head"] == "cpu")
    finally:
        cpu.use_isa(before)
    fail_build(monkeypatch)
    info = select.selection()
    assert not info["built"] and "no C++ compiler" in info["build_error"]
    assert set(info["kernels"].values()) == {"torch"} and info["isa"] == cpu.isa() and info["cpu"]
    with pytest.raises(ValueError, match="unknown kernels"):
        with select.force(gemm=True):
            pass


def _build_in(cache, cxx=None, count=1):
    """`count` processes that build the generic library into `cache` at once: their outputs."""
    env = {**os.environ, build.ENV_CACHE: str(cache), **({"CXX": cxx} if cxx else {})}
    script = "from dsv4batch.kernels import build; print(build.load('generic'), build.build_error('generic'))"
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(count)]
    return [p.communicate(timeout=1800)[0] for p in procs]


@pytest.mark.slow
def test_processes_that_start_together_build_once(tmp_path):
    assert all(out.startswith("True") for out in _build_in(tmp_path, count=3))
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    runs = (folder / ".ninja_log").read_text().splitlines()[1:]
    assert len(runs) == len(build.SOURCES) + 1  # each object and the link, once: the others waited


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("clang++") is None, reason="clang++ is not installed")
def test_clang_builds_it(tmp_path):
    assert _build_in(tmp_path, cxx="clang++")[0].startswith("True")
