"""User-facing errors. The CLI prints their message as one line and exits non-zero; anything else is a bug
and keeps its traceback."""

import os
import sys


class DistzoError(Exception):
    """A problem the user can fix; the message names it and the fix."""


class ConfigError(DistzoError):
    """A configuration value that cannot work; the message says which and how to fix it."""


def write_error_line(message: str) -> None:
    """Print `distzo: error: <message>` on stderr as ONE write of one line.

    Under torchrun every failing rank reports, and all ranks share torchrun's stderr. `print` may
    issue the text and its newline as two writes (it does when stderr is unbuffered, e.g. with
    PYTHONUNBUFFERED=1), so two ranks' lines could interleave into one. A single write(2) of under
    PIPE_BUF (4096) bytes to a pipe is atomic, and a line this short is also written whole to a file
    or terminal, so each rank's line arrives intact."""
    line = "distzo: error: " + " ".join(str(message).split("\n")) + "\n"
    data = line.encode("utf-8", errors="replace")
    try:
        sys.stderr.flush()  # whatever was printed before goes first
    except (OSError, ValueError):
        pass
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (captured output)
        sys.stderr.write(line)
        sys.stderr.flush()
        return
    while data:
        data = data[os.write(fd, data):]
