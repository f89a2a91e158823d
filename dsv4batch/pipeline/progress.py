"""Live progress on stderr: rows answered and tokens/s, polled from the `StatsCollector`.

A tqdm bar on a terminal; otherwise (CI, `ray job submit` logs) one line every `log_every` s.
"""

from __future__ import annotations

import sys
import threading
import time


class Progress:
    def __init__(self, collector, total: int | None, enabled: bool = True,
                 poll_s: float = 1.0, log_every: float = 10.0):
        self.collector, self.total, self.enabled = collector, total, enabled
        self.poll_s, self.log_every = poll_s, log_every
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar = None

    def __enter__(self) -> "Progress":
        if self.enabled:
            self._t0 = time.time()
            if sys.stderr.isatty():
                from tqdm import tqdm

                self._bar = tqdm(total=self.total, unit="row", desc="scoring", file=sys.stderr)
            self._thread = threading.Thread(target=self._loop, name="dsv4batch-progress",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._bar is not None:
            self._bar.close()

    def _poll(self) -> tuple[int, int]:
        import ray

        snap = ray.get(self.collector.snapshot.remote(), timeout=10)
        self.live = snap.get("live") or {}
        self.generated = sum(a.get("num_generated", 0) for a in snap["actors"])
        return (sum(a["rows"] for a in snap["actors"]),
                sum(a["input_tokens"] for a in snap["actors"]))

    def _generation(self) -> str:
        """The generating actors' latest state: '  running R waiting W  generated G' ('' if none)."""
        live = getattr(self, "live", None)
        if not live:
            return ""
        total = {k: sum(s.get(k, 0) for s in live.values()) for k in ("running", "waiting", "generated")}
        generated = self.generated + total["generated"]  # finished batches + the ones running
        return f"  running {total['running']} waiting {total['waiting']}  generated {generated}"

    def _loop(self) -> None:
        last_log = time.time()
        while not self._stop.wait(self.poll_s):
            try:
                rows, tokens = self._poll()
            except Exception:
                continue
            elapsed = max(time.time() - self._t0, 1e-9)
            rate = f"{tokens / elapsed:,.0f} tok/s" + self._generation()
            if self._bar is not None:
                self._bar.n = rows
                self._bar.set_postfix_str(rate, refresh=True)
            elif time.time() - last_log >= self.log_every:
                last_log = time.time()
                total = f"/{self.total}" if self.total is not None else ""
                print(f"[dsv4batch] {rows}{total} rows  {tokens} tokens  {rate}  "
                      f"{elapsed:.0f}s", file=sys.stderr, flush=True)
