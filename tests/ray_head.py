"""A real local Ray head (`ray start --head --block`) for tests: in its own process group, on
free ports, with a short temp dir, stopped by signalling that group (never `ray stop`, which
would stop every Ray on the machine, other users' included)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

BIN = os.path.dirname(sys.executable)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def http_status(url: str, token: str | None = None) -> int | None:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:  # not listening yet
        return None


def _token(env: dict) -> str | None:
    """The token a client of a head started with `env` sends (the env's, else ~/.ray's)."""
    if env.get("RAY_AUTH_TOKEN"):
        return env["RAY_AUTH_TOKEN"]
    path = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    if env.get("RAY_AUTH_MODE", "token") != "disabled" and os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    return None


@contextlib.contextmanager
def ray_head(env: dict, num_cpus: int = 2, timeout_s: float = 120):
    """A head with `num_cpus` CPUs, no GPU and the dashboard on 127.0.0.1, started with `env`;
    yields (GCS address 127.0.0.1:port, dashboard URL) once the dashboard answers."""
    gcs, dash, client, agent_http, agent_grpc, rt_env, metrics = free_ports(7)
    temp = tempfile.mkdtemp(prefix="rayt", dir="/tmp")  # short: Ray's socket paths are limited
    cmd = [f"{BIN}/ray", "start", "--head", "--block", f"--port={gcs}", f"--num-cpus={num_cpus}",
           "--num-gpus=0", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
           f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
           f"--runtime-env-agent-port={rt_env}", f"--metrics-export-port={metrics}",
           f"--temp-dir={temp}", "--disable-usage-stats"]
    env = {**env, "PATH": f"{BIN}:{env.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.time() + timeout_s
        while http_status(f"{url}/api/version", _token(env)) != 200:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the Ray head did not come up ({' '.join(cmd)})")
            time.sleep(0.2)
        yield f"127.0.0.1:{gcs}", url
    finally:
        _stop(proc)
        shutil.rmtree(temp, ignore_errors=True)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the head's own process group (raylet, GCS, dashboard, workers), SIGKILL what is
    left after a short grace (nothing of a test head needs saving)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


_joined: dict = {}  # the address this process joined last (Ray reports it normalized)


def join(address: str) -> None:
    """Make this process a driver of the cluster at `address` (leaving another one first)."""
    import ray

    if ray.is_initialized() and _joined.get("address") == address:
        return
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address=address, logging_level="WARNING")
    ray.data.DataContext.get_current().enable_progress_bars = False
    _joined["address"] = address


def leave(address: str | None = None) -> None:
    """Stop being a driver of `address` (before that cluster goes down), or of any cluster."""
    import ray

    if ray.is_initialized() and (address is None or _joined.get("address") == address):
        ray.shutdown()
        _joined.clear()
