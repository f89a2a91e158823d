"""What the CLIs leave for a failure they report in one line: the whole traceback, in a log file."""

from __future__ import annotations


def trace_file(exc: BaseException) -> str:
    """Write `exc`'s whole traceback to a log file; its path."""
    import os
    import tempfile
    import time
    import traceback

    path = os.path.join(tempfile.gettempdir(),
                        f"dsv4batch-error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log")
    with open(path, "w") as f:
        f.write("".join(traceback.format_exception(exc)))
    return path
