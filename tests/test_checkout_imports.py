"""A source checkout on ``sys.path`` must not hide installed packages. The top-level ``kernels`` link (to
``cca_convert/kernels``) has the name of the Hub's ``kernels`` package, which transformers >= 5.25 imports on
``import transformers``; ``python -m``/``-c``, pytest and the benchmarks put the repository root first on ``sys.path``.
``cca_convert/kernels`` is therefore a namespace package (no ``__init__.py``): Python takes a regular package found
anywhere on the path over a namespace directory, so the installed ``kernels`` wins and ours stays importable as
``cca_convert.kernels``."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import kernels
import cca_convert.kernels.dca_reference as ours
print(getattr(kernels, "WHO", "the checkout's link"))
print(ours.__name__)
"""


def test_an_installed_kernels_package_wins_over_the_checkouts_link(tmp_path):
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text('WHO = "the installed package"\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    # -c puts the working directory (the repository root) first on sys.path, before PYTHONPATH
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["the installed package", "cca_convert.kernels.dca_reference"]

