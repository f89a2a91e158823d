"""Errors as the user reads them: one line, Ray's wrappers unwrapped, no colour codes."""

from dsv4batch.jobspec.errors import one_line, row_error


def test_one_line_unwraps_causes_and_drops_colour_codes():
    class Wrapper(RuntimeError):  # what Ray's RayTaskError does: the original in `.cause`
        def __init__(self, cause):
            super().__init__("\x1b[36mray::MapWorker()\x1b[39m (pid=1)\nTraceback ...")
            self.cause = cause

    inner = ValueError("\x1b[31mbad\x1b[0m value\nmore detail")
    assert one_line(Wrapper(Wrapper(inner))) == "ValueError: bad value"
    assert one_line(KeyError()) == "KeyError: "
    assert row_error(ValueError("x" * 600)) == ("ValueError: " + "x" * 600)[:500]
