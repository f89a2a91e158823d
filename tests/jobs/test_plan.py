"""`dsv4batch plan`: the capacity plan on the command line (text, --json, --tp, exit codes)."""

import json
import os

import pytest

from dsv4batch.jobs.score import main
from dsv4batch.model.capacity import GIB, model_tensor_bytes, plan_capacity
from tests.model.test_quant_layout import FLASH, write_header_only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("flash"))
    write_header_only(path, FLASH)
    return path


def run(capsys, *args):
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_plan_is_the_library_plan(flash, capsys):
    code, out, _ = run(capsys, "--model", flash, "--gpu-memory-gib", "141", "--json")
    assert code == 0
    plan = json.loads(out)
    config, sizes, _ = model_tensor_bytes(flash)
    ref = plan_capacity(config, sizes, gpu_memory_bytes=141 * GIB, max_model_len=8192, max_batched_tokens=2048)
    assert plan["smallest_tp"] == 2 and plan["checkpoint_bytes"] == 159_609_485_896
    assert [r["total_bytes"] for r in plan["ranks"]] == [r["total_bytes"] for r in ref["ranks"]]
    assert plan["weights"]["total"] == ref["weights"]["total"]


def test_text_plan_and_exit_codes(flash, capsys):
    code, out, _ = run(capsys, "--model", flash, "--gpu-memory-gib", "141", "--tp", "1")
    assert code == 1  # tp 1 does not fit
    assert "checkpoint: 148.65 GiB of tensors (3.35 GiB of mtp.* not loaded)" in out
    assert "smallest tp that fits: 2" in out
    row = next(line for line in out.splitlines() if line.split()[:1] == ["1"])
    assert "no: a rank needs" in row
    code, out, _ = run(capsys, "--model", flash, "--gpu-memory-gib", "141", "--tp", "4", "--max-model-len", "1048576",
                       "--max-batched-tokens", "8192")
    # a 1M-token context: the replicated fp32 indexer scores of one query slice dominate
    assert code == 0 and "activations at tp 4: " in out and "indexer 64.25 GiB" in out
    assert "smallest tp that fits: 4" in out
    code, out, _ = run(capsys, "--model", flash, "--gpu-memory-gib", "16")
    assert code == 1 and "no tensor-parallel size fits: tp 1: a rank needs" in out and "tp 8: a rank needs" in out
    code, out, _ = run(capsys, "--model", "tiny", "--gpu-memory-gib", "1", "--dtype", "float32")
    assert code == 0 and "smallest tp that fits: 1" in out and "o_groups 2 is not divisible by tp 4" in out


def test_bad_arguments_exit_2(tmp_path, capsys):
    code, _, err = run(capsys, "--model", str(tmp_path / "missing"), "--gpu-memory-gib", "141")
    assert code == 2 and "is not a folder" in err
    code, _, err = run(capsys, "--model", "tiny", "--gpu-memory-gib", "-1")
    assert code == 2 and "--gpu-memory-gib must be positive" in err
    code, _, err = run(capsys, "--model", "tiny")
    assert code == 2 and "--gpu-memory-gib" in err


def test_console_entry_point_dispatches_plan(run_cli):
    out = run_cli("plan", "--model", "tiny", "--gpu-memory-gib", "141", "--json", cwd=ROOT,
                  env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["smallest_tp"] == 1
