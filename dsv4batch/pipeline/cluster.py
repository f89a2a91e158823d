"""Join or start Ray for a run.

`address` (or RAY_ADDRESS, which `ray job submit` sets for the job's driver) joins a running
cluster ('auto' finds one started with `ray start` on this machine); otherwise a new local Ray
starts, never another `ray start` cluster that happens to run here, with token authentication
(Ray >= 2.52 enables it for new local clusters unless RAY_AUTH_MODE says otherwise; the token
is ~/.ray/auth_token or RAY_AUTH_TOKEN), listening on loopback only (`loopback_node`): its
dashboard, its Prometheus metrics ports (the dashboard's, the node agent's, the autoscaler
monitor's) and its gRPC services on 127.0.0.1. A user who wants them elsewhere starts Ray
themselves and passes --ray-address.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading

# Ray's switch for "this node is not part of a cluster": its node IP is then 127.0.0.1, which
# Ray's metrics servers (dashboard, agent, autoscaler monitor) bind to instead of 0.0.0.0 (Ray
# 2.60 has no bind-address option for them; they follow `is_localhost(node_ip)`)
NO_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def probe(address: str, timeout_s: float = 10.0) -> None:
    """Refuse at once a `host:port` (or `ray://host:port`) nothing listens on; Ray itself would
    retry the connection for minutes, printing warnings."""
    import socket

    from dsv4batch.jobspec.errors import UsageError

    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return  # 'auto', 'local' or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise UsageError(f"cannot reach the Ray cluster at {address!r} ({exc}); check "
                         "--ray-address / RAY_ADDRESS and that `ray start` runs there") from exc


def connect(address: str | None = None, **local_kwargs) -> bool:
    """Initialize Ray unless it already is; returns True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        probe(address)
    common = {"logging_level": logging.WARNING, "log_to_driver": True}
    # ray.init replaces the SIGTERM handler with sys.exit(15); keep the caller's (the CLI
    # stops like on Ctrl-C: lease released, a message, exit 143)
    main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main else None
    if address:
        ray.init(address=address, **common)
    else:
        with loopback_node():
            ray.init(address="local", dashboard_host="127.0.0.1", **common, **local_kwargs)
    if main and sigterm not in (None, signal.SIG_DFL):
        signal.signal(signal.SIGTERM, sigterm)
    return True


@contextlib.contextmanager
def loopback_node():
    """While a local Ray starts: its node IP is 127.0.0.1 (Ray's single-machine mode, set for the
    driver's check and, through the environment, for the processes it starts), so every port it
    opens listens on loopback. Both are restored afterwards; the started processes keep it."""
    from ray._private import ray_constants

    before_env, before_flag = os.environ.get(NO_CLUSTER_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[NO_CLUSTER_ENV], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before_flag
        if before_env is None:
            os.environ.pop(NO_CLUSTER_ENV, None)
        else:
            os.environ[NO_CLUSTER_ENV] = before_env


def configure_data_context(progress_bars: bool = False) -> None:
    """Ray Data settings for a scoring run (set before the dataset is built)."""
    from ray.data import DataContext

    from dsv4batch.pipeline.faults import fault_settings

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = progress_bars
    fault_settings(ctx)
