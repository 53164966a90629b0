"""No machine paths in what gets published: reports and model cards name local files relative to the directory the
run started in when they lie below it, else by their file name (``/home/ana/data/held.txt`` -> ``held.txt``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

# an absolute path inside text: a "/" that starts a token (not a URL's "//", a Hub id's "org/name" or "c/4")
_ABSOLUTE = re.compile(r"(?<![\w.:/~-])/[^\s,\]\}\)'\"`|]+")


def portable(path: str, start: Path | None = None) -> str:
    """``path`` relative to ``start`` (default: the current directory) when it lies below it, else its name."""
    start = Path(start or Path.cwd()).resolve()
    p = Path(os.path.expanduser(path))
    if not p.is_absolute():
        return path
    try:
        return p.resolve().relative_to(start).as_posix()
    except ValueError:
        return p.name or path


def portable_text(text: str, start: Path | None = None) -> str:
    """Every absolute path in ``text`` made portable (see ``portable``)."""
    return _ABSOLUTE.sub(lambda m: portable(m.group(0), start), text)
