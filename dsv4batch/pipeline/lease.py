"""The exclusive writer of an OUTPUT folder: `_lease.json`, held while a job runs.

A job creates the lease atomically before it looks at OUTPUT (local and POSIX shared file
systems: `O_CREAT | O_EXCL`, which NFSv3+ honours), records host, pid, run id and the time,
and renews it every `RENEW_S` seconds from a thread; it deletes it when the job ends. A second
job on the same OUTPUT is refused, naming the holder. A lease not renewed for `TTL_S` seconds
is stale (its job was killed), and so is one whose holder ran on this host and whose process is
gone: the next job takes it over with a message; `.takeover`, made the same atomic way, lets
only one job do that at a time.

Object stores (s3://, gs://) have no exclusive create through pyarrow: there the lease is
written, read back after a pause, and kept only if it is still ours. That catches jobs started
seconds apart, not two started in the same instant: give concurrent jobs distinct OUTPUTs.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

from dsv4batch.jobspec.errors import UsageError
from dsv4batch.pipeline.output import LEASE, staged

TTL_S = 60.0
RENEW_S = 10.0


def _dead(held: dict) -> bool:
    """The holder ran on this host and its process is gone (killed): no need to wait TTL_S."""
    if held.get("host") != socket.gethostname() or not isinstance(held.get("pid"), int):
        return False
    try:
        os.kill(held["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


class Lease:
    def __init__(self, fs, root: str, run_id: str, log=None):
        self.fs, self.root, self.run_id, self.log = fs, root, run_id, log or (lambda m: None)
        self.path = f"{root}/{LEASE}"
        self.local = type(fs).__name__ == "LocalFileSystem"
        self.token = uuid.uuid4().hex
        self.lost: str | None = None  # why the lease was lost while the job ran
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                           "run_id": self.run_id, "token": self.token,
                           "renewed": time.time(), "ttl_s": TTL_S}).encode()

    def _read(self) -> dict | None:
        try:
            with self.fs.open_input_stream(self.path) as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None
        except Exception:  # noqa: BLE001 - half written or not JSON: treat as a fresh lease
            return {"renewed": time.time(), "host": "?", "pid": "?", "run_id": "?"}

    def _create(self, path: str) -> bool:
        """Create `path` holding our record; False when it exists already."""
        if self.local:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(self._record())
            return True
        if self.fs.get_file_info(path).type.name != "NotFound":
            return False
        with self.fs.open_output_stream(path) as f:
            f.write(self._record())
        time.sleep(1.0)  # then read back: another writer in that second replaced it
        return (self._read() or {}).get("token") == self.token

    def acquire(self) -> "Lease":
        """Hold the lease or raise `UsageError` naming the job that holds it."""
        if self.fs.get_file_info(self.root).type.name == "File":
            raise UsageError(f"OUTPUT {self.root!r} is a file; it must be a folder")
        for _ in range(3):
            try:
                self.fs.create_dir(self.root, recursive=True)
                created = self._create(self.path)
            except OSError as exc:
                raise UsageError(f"OUTPUT {self.root!r} is not writable: {exc}") from exc
            if created:
                self._thread = threading.Thread(target=self._renew, daemon=True,
                                                name="dsv4batch-lease")
                self._thread.start()
                return self
            held = self._read()
            if held is None:
                continue  # released in between
            age = time.time() - float(held.get("renewed", 0))
            if age <= float(held.get("ttl_s", TTL_S)) and not _dead(held):
                raise UsageError(
                    f"OUTPUT {self.root!r} is being written by another job (run "
                    f"{held.get('run_id')}, pid {held.get('pid')} on {held.get('host')}, renewed "
                    f"{age:.0f}s ago); wait for it to finish, or give another OUTPUT")
            self._take_over(held, age)
        raise UsageError(f"OUTPUT {self.root!r}: could not take its lease ({LEASE})")

    def _take_over(self, held: dict, age: float) -> None:
        mutex = self.path + ".takeover"
        if not self._create(mutex):
            info = self.fs.get_file_info(mutex)
            mtime = info.mtime.timestamp() if info.mtime else time.time()
            if time.time() - mtime > TTL_S:  # a job died while taking over
                self.fs.delete_file(mutex)
            return
        try:
            again = self._read()
            if again is not None and again.get("renewed") == held.get("renewed"):
                self.log(f"[dsv4batch] taking over the stale lease of run {held.get('run_id')} "
                         f"(pid {held.get('pid')} on {held.get('host')}, not renewed for "
                         f"{age:.0f}s)")
                self.fs.delete_file(self.path)
        finally:
            self.fs.delete_file(mutex)

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                held = self._read()
                if held is None or held.get("token") != self.token:
                    self.lost = (f"the OUTPUT lease was taken by run {(held or {}).get('run_id')}"
                                 " while this job ran")
                    return
                with staged(self.fs, self.root, LEASE) as f:
                    f.write(self._record())
            except Exception:  # noqa: BLE001 - retried at the next renewal
                continue

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            if (self._read() or {}).get("token") == self.token:
                self.fs.delete_file(self.path)
        except Exception:  # noqa: BLE001 - a stale lease is taken over by the next job
            pass

    def __enter__(self) -> "Lease":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
