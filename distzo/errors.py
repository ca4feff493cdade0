"""User-facing errors. The CLI prints their message as one line and exits non-zero; anything else is a bug
and keeps its traceback."""


class DistzoError(Exception):
    """A problem the user can fix; the message names it and the fix."""
