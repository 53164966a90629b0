"""Round-trip stage: load the exported folder the way users will, and compare logits.

The check runs in a fresh Python process where ``cca_convert`` cannot be imported, with an empty
transformers module cache, so it proves the folder is self-contained: ``config.json``'s ``auto_map``,
the published code files and the weights are all that the loaded model gets.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

from .errors import CCAError

_LOADER = textwrap.dedent(
    """
    import ctypes, importlib.abc, os, signal, sys

    if sys.platform.startswith("linux"):  # die with the converter, even on its kill -9 (PR_SET_PDEATHSIG)
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
        if os.getppid() != int(sys.argv[5]):  # the parent died before prctl took effect
            sys.exit(1)

    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "cca_convert" or name.startswith("cca_convert."):
                raise ImportError("cca_convert must not be importable in the round-trip check")

    sys.meta_path.insert(0, _Block())
    import torch
    from transformers import AutoModelForCausalLM

    folder, ids_path, out_path, device = sys.argv[1:5]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype="auto").to(device).eval()
    with torch.no_grad():
        logits = model(torch.load(ids_path).to(device), use_cache=False).logits.float().cpu()
    torch.save(logits, out_path)
    """
)


def probe_ids(vocab_size: int, length: int) -> torch.Tensor:
    """Deterministic token ids for the check (no tokenizer needed)."""
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (1, length), generator=gen)


def model_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids.to(model.device), use_cache=False).logits.float().cpu()


TEMP_PREFIX = "cca-roundtrip-"


def remove_dead_temp_folders() -> None:
    """Temp folders of round trips whose converter was killed (kill -9: its PID is gone); a live one is left."""
    import shutil

    from .export import _pid_alive

    for folder in Path(tempfile.gettempdir()).glob(f"{TEMP_PREFIX}*-*"):
        pid = folder.name[len(TEMP_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def exception_line(stderr: str) -> str:
    """The line naming a Python process's last exception (``torch.AcceleratorError: CUDA error: out of memory``),
    not the last line of its stderr: CUDA's messages end in advice ("Compile with `TORCH_USE_CUDA_DSA`...")."""
    lines = stderr.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if starts:  # the first unindented line after the last traceback's frames
        for line in lines[starts[-1] + 1:]:
            if line.strip() and not line[0].isspace():
                return line
    return lines[-1] if lines else "no output"


def roundtrip_check(folder: Path, input_ids: torch.Tensor, expected: torch.Tensor, atol: float, device="cpu") -> float:
    """Load ``folder`` in a clean subprocess; raise CCAError unless its logits match ``expected``."""
    remove_dead_temp_folders()
    with tempfile.TemporaryDirectory(prefix=f"{TEMP_PREFIX}{os.getpid()}-") as tmp:
        ids_path, out_path = Path(tmp) / "ids.pt", Path(tmp) / "logits.pt"
        torch.save(input_ids, ids_path)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(HF_MODULES_CACHE=str(Path(tmp) / "modules"), HF_HUB_OFFLINE="1")
        proc = subprocess.run(
            [sys.executable, "-c", _LOADER, str(folder), str(ids_path), str(out_path), str(device), str(os.getpid())],
            cwd=tmp, env=env, capture_output=True, text=True,
        )
        if proc.returncode != 0:
            raise CCAError(f"round trip: the exported folder does not load with trust_remote_code: "
                           f"{exception_line(proc.stderr)}")
        got = torch.load(out_path).float()
    if got.shape != expected.shape:
        raise CCAError(f"round trip: logits shape {tuple(got.shape)} != in-process {tuple(expected.shape)}")
    diff = (got - expected).abs().max().item()
    if not diff <= atol:
        raise CCAError(f"round trip: exported model's logits differ from the in-process model's by {diff:.3g} (> {atol})")
    return diff
