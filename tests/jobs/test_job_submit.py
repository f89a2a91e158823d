"""A real local head (`ray start --head`, token authentication, dashboard on 127.0.0.1), the job
submitted with the `ray job submit` command, its output checked, and the head stopped."""

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.jobs.conftest import TEXTS, read_output

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def http_status(url, token=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:  # not listening yet
        return None


@pytest.fixture(scope="module")
def head():
    """`ray start --head --block` in its own process group, stopped at the end."""
    gcs, dash, client, agent_http, agent_grpc, rt_env, metrics = free_ports(7)
    temp = tempfile.mkdtemp(prefix="rayjob", dir="/tmp")  # short: Ray's socket paths are limited
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}
    env.pop("RAY_ADDRESS", None)
    cmd = [f"{BIN}/ray", "start", "--head", "--block", f"--port={gcs}", "--num-cpus=2",
           "--num-gpus=0", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
           f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
           f"--runtime-env-agent-port={rt_env}", f"--metrics-export-port={metrics}",
           f"--temp-dir={temp}", "--disable-usage-stats"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.time() + 120
        while http_status(f"{url}/api/version", env["RAY_AUTH_TOKEN"]) != 200:
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail("ray head did not come up")
            time.sleep(1)
        yield url, env
    finally:
        # SIGTERM to the head's own process group (its raylet, GCS, dashboard, workers):
        # `ray stop` is not used, it would stop every Ray on the machine
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    shutil.rmtree(temp, ignore_errors=True)


def test_ray_job_submit(tmp_path, checkpoint, head):
    url, env = head
    assert http_status(f"{url}/api/jobs/") == 401  # token authentication is on
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "prompt": TEXTS}), src)
    out = tmp_path / "out"
    submit = [f"{BIN}/ray", "job", "submit", "--address", url, "--working-dir", REPO, "--",
              "python", "-m", "dsv4batch.jobs.score", str(src), str(out), "--model", checkpoint,
              "--cpus-per-replica", "0.5", "--tokenize-num-cpus", "0.25", "--batch-size", "4"]
    res = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "succeeded" in res.stdout + res.stderr
    table, metrics = read_output(out)
    assert sorted(table["id"].to_pylist()) == list(range(len(TEXTS)))
    assert metrics["rows_errored"] == 1  # the null text
    with open(out / "_job.json") as f:
        assert json.load(f)["config"]["model"] == checkpoint


@pytest.mark.parametrize("token", [None, "not-the-token"])
def test_job_submitted_without_the_token_is_refused(tmp_path, head, token):
    url, env = head
    client = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    client["HOME"] = str(tmp_path)  # no ~/.ray/auth_token to fall back on
    if token:
        client.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    marker = tmp_path / "ran"
    submit = [f"{BIN}/ray", "job", "submit", "--address", url, "--", "python", "-c",
              f"open({str(marker)!r}, 'w').close()"]
    res = subprocess.run(submit, env=client, capture_output=True, text=True, timeout=120)
    text = res.stdout + res.stderr
    assert res.returncode != 0, text[-2000:]
    assert "401" in text or "nauthorized" in text or "authentication" in text.lower(), text[-2000:]
    assert not marker.exists()  # the entrypoint never ran
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(f"{url}/api/jobs/", headers=headers)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=5)
    assert refused.value.code in (401, 403)
