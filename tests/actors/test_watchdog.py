"""The watchdog kills a process whose batch runs past the timeout, and leaves no file behind."""

import os
import signal
import subprocess
import sys

CODE = """
import sys, time
from dsv4batch.actors.watchdog import Watchdog
dog = Watchdog(float(sys.argv[1]))
dog.busy()
time.sleep(float(sys.argv[2]))
dog.idle()
print("done", flush=True)
"""


def run(tmp_path, timeout: float, sleep: float):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    return subprocess.run([sys.executable, "-c", CODE, str(timeout), str(sleep)], env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_batch_past_the_timeout_is_killed_and_no_file_is_left(tmp_path):
    out = run(tmp_path, 1.0, 30)
    assert out.returncode == -signal.SIGKILL and "a batch ran past --batch-timeout-s 1" in out.stderr
    assert os.listdir(tmp_path) == []


def test_a_quick_batch_finishes_and_no_file_is_left(tmp_path):
    out = run(tmp_path, 30.0, 0.1)
    assert out.returncode == 0 and out.stdout.strip() == "done"
    assert os.listdir(tmp_path) == []
