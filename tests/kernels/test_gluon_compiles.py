"""The Hopper Gluon forwards (and the DCA Triton kernel's decode form) compile for sm_90 on a machine without a GPU
(``tests/support/sm90_compile.py``: triton's front end and bundled ptxas, a stand-in driver), with the triton they are
verified on: a kernel edit is checked on the CPU as far as compiling goes (``make test-oldest``); the GPU tests check
its numbers."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
gluon_parts = pytest.importorskip("cca_convert.kernels.gluon_parts")

ROOT = Path(__file__).resolve().parents[2]
# One line per build of tests/support/sm90_compile.py: a build added there is added here, so none goes unchecked.
BUILDS = ["dca d128", "dca d64 temperature", "dca decode (Triton)", "dca decode (Triton) temperature",
          "dca decode (Triton) pointer loads", "cca d128", "cca d64"]


@pytest.mark.skipif(".".join(triton.__version__.split(".")[:2]) != gluon_parts.VERIFIED_TRITON,
                    reason="the Gluon kernels are verified on triton 3.6 (gluon_parts.VERIFIED_TRITON)")
def test_hopper_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not found in a cache
    proc = subprocess.run([sys.executable, "-m", "tests.support.sm90_compile"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    compiled = [line.split(": sm_90 cubin")[0] for line in proc.stdout.splitlines() if ": sm_90 cubin" in line]
    assert compiled == BUILDS, proc.stdout
