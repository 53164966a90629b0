"""The environment of a child Python process that runs this checkout."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def checkout_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with this checkout first on PYTHONPATH and the caller's entries after it, made absolute. A child
    started in another folder (a test's tmp_path) reads a relative entry such as ``.`` there, so a GPU run's
    ``PYTHONPATH=/tmp/pylib:.`` handed on as it is loses the checkout; replaced by the checkout alone, it loses the
    packages installed under /tmp/pylib."""
    inherited = [str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys([str(REPO), *inherited])), **extra}
