"""Every ``cca-convert`` command in the README that needs no download runs as written, after the README's own set-up
(``make demo``, whose command is read from the Makefile). Commands that name a Hub id or a placeholder (MODEL, SOURCE,
you/model-cca...) need a download or a value of the reader's: they are listed, not run. ``serve`` is tested in
tests/test_serve.py (it does not exit by itself)."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.child_env import checkout_env

REPO = Path(__file__).resolve().parents[1]
LOCAL = {"examples", "out"}  # the embedded model and what `make demo` writes
PLACEHOLDERS = re.compile(r"\b(SOURCE|MODEL|BASE|DIR|DIR_OR_REPO|REPO|FILE|KEY=VALUE|R\.yaml|you/|user/)|\[")


def readme_commands() -> list[str]:
    """The ``cca-convert`` lines of the README's shell blocks, comments stripped."""
    text = (REPO / "README.md").read_text()
    lines = []
    for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("cca-convert "):
                lines.append(line)
    return lines


def runnable(line: str) -> bool:
    """No placeholder, not serve, and the model is one of the README's local folders (the embedded model, or the
    demo's output), not a Hub id."""
    words = shlex.split(line)[1:]
    source = words[1] if words[0] == "validate" else words[0]
    return not PLACEHOLDERS.search(line) and words[0] != "serve" and source.split("/")[0] in LOCAL


def test_the_readme_has_commands_that_run_here():
    commands = readme_commands()
    assert len(commands) >= 10 and sum(map(runnable, commands)) >= 3, commands


@pytest.mark.slow
def test_every_readme_command_that_needs_no_download_runs(tmp_path):
    make = (REPO / "Makefile").read_text()
    demo = re.search(r"^demo: .*\n\t\$\(VENV\)/bin/(cca-convert .*)$", make, flags=re.M).group(1)
    for name in ("examples", "recipes"):  # the README's relative paths, from a scratch folder
        (tmp_path / name).symlink_to(REPO / name)
    cli = [sys.executable, "-m", "cca_convert.cli"]
    env = checkout_env()
    setup = subprocess.run(cli + shlex.split(demo)[1:], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert setup.returncode == 0, setup.stderr[-2000:]
    ran = []
    for line in readme_commands():
        if not runnable(line):
            continue
        proc = subprocess.run(cli + shlex.split(line)[1:], cwd=tmp_path, capture_output=True, text=True, env=env)
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}"
        ran.append(line)
    print("\nran:\n  " + "\n  ".join(ran))
    assert ran


@pytest.mark.parametrize("line,expect", [
    ("cca-convert validate out/tiny-cca", True),
    ("cca-convert validate user/model-cca --output val", False),
    ("cca-convert meta-llama/Llama-2-7b-hf --set method=dca", False),
    ("cca-convert SOURCE [--recipe FILE]", False),
    ("cca-convert serve out/tiny-cca --port 8000", False),
])
def test_what_counts_as_needing_no_download(line, expect):
    assert runnable(line) is expect


def readme_benchmark_commands() -> list[str]:
    """The README's ``python benchmarks/NAME.py ...`` commands (in code spans and shell blocks)."""
    text = (REPO / "README.md").read_text()
    found = re.findall(r"python (benchmarks/\w+\.py(?: [^`\n#]*)?)", text)
    return sorted({line.strip() for line in found})


class _Parsed(Exception):
    pass


def test_every_readme_benchmark_command_parses(monkeypatch):
    """Each benchmark command the README shows names a script that exists and flags its parser accepts (parsed by
    the script's own ``main``, stopped right after ``parse_args``: nothing is run): a renamed or dropped flag fails
    here, not in a reader's shell."""
    import argparse
    import importlib

    commands = readme_benchmark_commands()
    assert len(commands) >= 5, commands
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    for line in commands:
        script, *args = shlex.split(line)
        assert (REPO / script).is_file(), line
        module = importlib.import_module(script[:-3].replace("/", "."))
        monkeypatch.setattr(sys, "argv", [script, *args])
        with pytest.raises(_Parsed):
            module.main()
