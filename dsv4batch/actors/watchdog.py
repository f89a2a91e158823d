"""A replica actor's watchdog: a child process that kills the actor when it hangs.

A thread cannot do it: a stopped process (SIGSTOP), a hung collective or a C call holding the
GIL stops every thread of the actor. The actor writes two floats to a small unlinked file (it
is shared through an inherited descriptor, so nothing is left in /tmp whatever kills whom): a heartbeat,
every `timeout_s / 10` s from a thread, and the start time of the batch it is scoring (0 when
idle). The child SIGKILLs the actor when the heartbeat is older than `timeout_s` (the process
is frozen, even between batches, with batches queued to it) or a batch has run for
`timeout_s`; Ray then restarts the actor and retries the batch like any crash (the batch ledger
counts the attempt). The child exits as soon as the actor's process is gone.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import tempfile
import threading
import time

CHILD = r"""
import os, signal, struct, sys, time
parent, fd, timeout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
poll = min(1.0, timeout / 10)
while os.getppid() == parent:
    time.sleep(poll)
    beat, started = struct.unpack("dd", os.pread(fd, 16, 0))
    now = time.time()
    what = ("a batch ran" if started and now - started > timeout else
            "the actor's heartbeat stopped" if now - beat > timeout else None)
    if what:
        print(f"[dsv4batch] watchdog: {what} past --batch-timeout-s {timeout:g}; "
              f"killing actor process {parent}", file=sys.stderr, flush=True)
        os.kill(parent, signal.SIGKILL)
        break
"""


class Watchdog:
    def __init__(self, timeout_s: float):
        fd, path = tempfile.mkstemp(prefix="dsv4batch-watchdog-")
        os.unlink(path)  # the two processes share it through `fd` only
        self.fd, self.every = fd, min(1.0, timeout_s / 10)
        self._beat()
        self.idle()
        threading.Thread(target=self._beats, daemon=True, name="dsv4batch-heartbeat").start()
        self.child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(os.getpid()), str(fd), repr(float(timeout_s))],
            stdin=subprocess.DEVNULL, close_fds=True, pass_fds=(fd,))

    def _beat(self) -> None:
        os.pwrite(self.fd, struct.pack("d", time.time()), 0)

    def _beats(self) -> None:
        while True:
            time.sleep(self.every)
            self._beat()

    def busy(self) -> None:
        """A batch starts now."""
        os.pwrite(self.fd, struct.pack("d", time.time()), 8)

    def idle(self) -> None:
        os.pwrite(self.fd, struct.pack("d", 0.0), 8)
