"""A real local head (`ray start --head`, token authentication, dashboard on 127.0.0.1), the job
submitted with the `ray job submit` command, its output checked, and the head stopped."""

import json
import os
import secrets
import subprocess
import urllib.error
import urllib.request

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.jobs.conftest import TEXTS, read_output
from tests.ray_head import BIN, http_status, ray_head

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def job_head():
    """Its own head with token authentication (the session's head runs without a fixed token):
    (dashboard URL, the environment that holds the token)."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}
    with ray_head(env) as (_, url):
        yield url, {**env, "PATH": f"{BIN}:{os.environ['PATH']}"}


def test_ray_job_submit(tmp_path, checkpoint, job_head):
    url, env = job_head
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
def test_job_submitted_without_the_token_is_refused(tmp_path, job_head, token):
    url, env = job_head
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
