"""Errors cca-convert reports to the user.

A ``CCAError`` carries a one-line, actionable message: the CLI prints ``error: <message>`` and exits
with status 2, without a traceback. Raise it for problems the user can fix (a typo in a model id, a
missing login, no network); let real bugs propagate as ordinary exceptions.
"""


class CCAError(Exception):
    """A user-facing error: ``str(err)`` is a single actionable line."""

    exit_code = 2
