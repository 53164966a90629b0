"""The output guard: ``--overwrite`` never destroys what the user owns, whatever the spelling of ``--output``.

Each row runs the real CLI with ``--overwrite`` and an output that names (or holds, or lies inside) something the
user owns; it must exit 2 with one ``error:`` line and leave every byte of the workspace as it was (a hash of the
whole folder before and after)."""

import hashlib
import os
import re
from pathlib import Path

import pytest
import yaml

from cca_convert.cli import main
from cca_convert.output_guard import OUTPUT_MARKERS, check_output, protected_paths
from cca_convert.errors import CCAError
from tests.support.factories import save_base

RECIPE = {"cca": {"group_size": 4, "local_window": 16}, "export": {"dtype": "float32", "roundtrip": False},
          "finetune": {"enabled": False}, "validate": {"enabled": False}}


def tree_hash(folder: Path) -> str:
    """Every path (links as their target's text) and every file's bytes under ``folder``."""
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        h.update(str(path.relative_to(folder)).encode())
        if path.is_symlink():
            h.update(os.readlink(path).encode())
        elif path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """A user's folder: a source model, an unrelated notes file beside it, a recipe and a held-out file."""
    root = tmp_path / "work"
    save_base(root / "models" / "base", max_position_embeddings=512)
    (root / "models" / "notes.txt").write_text("my notes\n")
    (root / "recipe.yaml").write_text(yaml.safe_dump(RECIPE))
    (root / "data").mkdir()
    (root / "data" / "held.txt").write_text("held-out text\n" * 50)
    (root / "link-to-base").symlink_to(root / "models" / "base", target_is_directory=True)
    monkeypatch.chdir(root)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    return root


OUTPUTS = {  # --output spelling -> the error it must give
    "source": ("models/base", r"is the source model"),
    "source-trailing-slash": ("models/base/", r"is the source model"),
    "source-dotdot": ("models/base/sub/..", r"is the source model"),
    "parent-of-source": ("models/base/..", r"holds the source model"),
    "parent-via-sub-dotdot": ("models/sub/..", r"holds the source model"),
    "symlink-to-source": ("link-to-base", r"is the source model"),
    "inside-source": ("models/base/out", r"lies inside the source model"),
    "inside-source-via-symlink": ("link-to-base/out", r"lies inside the source model"),
    "current-directory": (".", r"is the current directory"),
    "ancestor-of-cwd": ("..", r"holds the current directory"),
    "home": ("~", r"is the home directory"),
    "recipe-file": ("recipe.yaml", r"is the recipe"),
    "data-folder": ("data", r"holds a data file"),
    "data-file": ("data/held.txt", r"is a data file"),
}


@pytest.mark.parametrize("case", list(OUTPUTS))
def test_overwrite_never_destroys_the_users_files(case, workspace, capsys):
    output, pattern = OUTPUTS[case]
    recipe = ["--recipe", "recipe.yaml", "--set", "validate.enabled=true", "--set",
              "validate.data={files: [data/held.txt]}"] if case.startswith("data") else ["--recipe", "recipe.yaml"]
    before = tree_hash(workspace)
    assert main(["models/base", *recipe, "--output", output, "--overwrite"]) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and re.search(pattern, errors[0]), errors
    assert tree_hash(workspace) == before, "the workspace changed"


def test_overwrite_of_a_folder_cca_convert_did_not_write_is_refused(workspace, capsys):
    (workspace / "mine").mkdir()
    (workspace / "mine" / "thesis.tex").write_text("years of work\n")
    before = tree_hash(workspace)
    assert main(["models/base", "--recipe", "recipe.yaml", "--output", "mine", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "replaces only a previous cca-convert output" in err and "mine" in err
    assert tree_hash(workspace) == before


def test_overwrite_replaces_a_previous_output_and_an_empty_folder(workspace, capsys):
    (workspace / "empty").mkdir()
    assert main(["models/base", "--recipe", "recipe.yaml", "--output", "empty", "--overwrite"]) == 0
    assert all((workspace / "empty" / m).is_file() for m in OUTPUT_MARKERS)
    (workspace / "empty" / "stale.txt").write_text("from the earlier run\n")
    assert main(["models/base", "--recipe", "recipe.yaml", "--output", "empty", "--overwrite"]) == 0
    assert not (workspace / "empty" / "stale.txt").exists()
    source_before = tree_hash(workspace / "models")
    assert main(["link-to-base", "--recipe", "recipe.yaml", "--output", "empty", "--overwrite"]) == 0
    assert tree_hash(workspace / "models") == source_before


def test_a_hub_source_cache_folder_is_protected_too(tmp_path):
    """The pipeline checks again once a Hub id is resolved to its cache folder (the CLI's early check cannot)."""
    cache = tmp_path / "hub" / "models--org--m" / "snapshots" / "abc"
    cache.mkdir(parents=True)
    (cache / "config.json").write_text("{}")
    (cache / "cca_recipe.yaml").write_text("")  # even a folder that looks like an output
    for out in (cache, cache.parent, cache / "x"):
        with pytest.raises(CCAError, match="source model"):
            check_output(out, True, protected_paths(source=cache))
