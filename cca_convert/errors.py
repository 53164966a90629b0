"""Errors cca-convert reports to the user.

A ``CCAError`` carries a one-line, actionable message: the CLI prints ``error: <message>`` and exits
with status 2, without a traceback. Raise it for problems the user can fix (a typo in a model id, a
missing login, no network); let real bugs propagate as ordinary exceptions.
"""


class CCAError(Exception):
    """A user-facing error: ``str(err)`` is a single actionable line."""

    exit_code = 2


def first_line(exc: BaseException) -> str:
    """The first useful line of an exception's message, following ``raise ... from`` causes past generic wrappers
    (datasets' "An error occurred while generating the dataset" hides "JSON parse error ... in row 0"), and
    completing a line that ends in ':' with the next one."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    best = ""
    for e in chain:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        if not lines:
            continue
        text = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
        if not best or "error occurred while generating" in best.lower():
            best = text
    if best:
        return best
    return type(chain[0]).__name__ if chain else ""
