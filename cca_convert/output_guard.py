"""Where a run may write: the output folder is checked against everything the user owns before anything happens.

``--overwrite`` replaces only a previous cca-convert output (a folder holding the ``cca_recipe.yaml`` and
``config.json`` that every export writes) or an empty folder. Never the source model, a folder that holds it or
lies inside it, a data file or the recipe (or a folder holding them), the current directory or the home directory,
whatever the spelling: every path is resolved (symlinks, ``..``, trailing slashes) and compared by identity
(``os.path.samefile``), so two spellings of one folder on a case-insensitive file system are caught too.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from .errors import CCAError

# Every export writes both; together they mark a folder as cca-convert's own (what --overwrite may replace).
OUTPUT_MARKERS = ("cca_recipe.yaml", "config.json")


def is_previous_output(folder: Path) -> bool:
    return all((folder / name).is_file() for name in OUTPUT_MARKERS)


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet: compare the resolved spellings
        return os.path.normcase(str(a)) == os.path.normcase(str(b))


def _lineage(path: Path) -> list[Path]:
    """``path`` and every folder above it."""
    return [path, *path.parents]


def _inside(inner: Path, outer: Path) -> bool:
    """``inner`` is ``outer`` or lies somewhere below it."""
    return any(_same(p, outer) for p in _lineage(inner))


def protected_paths(source: Path | None = None, recipe: Path | None = None,
                    data_files: Iterable[str | Path] = ()) -> list[tuple[str, Path, bool]]:
    """(what it is, resolved path, whether the output may not lie inside it either) for everything a run must
    never replace. The source model is protected from inside too: its files would be moved away with the output."""
    out = [("the current directory", Path.cwd().resolve(), False), ("the home directory", Path.home().resolve(), False)]
    if source is not None and Path(source).exists():
        out.append(("the source model", Path(source).resolve(), True))
    if recipe is not None and Path(recipe).exists():
        out.append(("the recipe", Path(recipe).resolve(), False))
    for f in data_files:
        if Path(f).exists():
            out.append(("a data file", Path(f).resolve(), False))
    return out


def check_output(output: Path, overwrite: bool, protected: list[tuple[str, Path, bool]] | None = None) -> None:
    """Refuse (CCAError, nothing touched) an output that would destroy something the user owns; see the module doc."""
    output = Path(output).expanduser()
    real = output.resolve()
    for what, path, no_inside in protected if protected is not None else protected_paths():
        if _same(real, path):
            raise CCAError(f"--output {output} is {what} ({path}): cca-convert never writes over it; choose "
                           "another --output")
        if _inside(path, real):
            raise CCAError(f"--output {output} holds {what} ({path}): replacing it would delete that; choose "
                           "another --output")
        if no_inside and _inside(real, path):
            raise CCAError(f"--output {output} lies inside {what} ({path}): choose an --output outside it")
    if real.exists() and not real.is_dir():
        raise CCAError(f"--output {output} exists and is not a folder; choose another --output")
    if real.is_dir() and any(real.iterdir()):
        if not overwrite:
            raise CCAError(f"output folder {output} exists and is not empty; pass --overwrite or choose another "
                           "--output")
        if not is_previous_output(real):
            raise CCAError(f"--overwrite replaces only a previous cca-convert output, and {output} is not one (no "
                           f"{' / '.join(OUTPUT_MARKERS)}); choose a new or empty --output, or empty that folder "
                           "yourself")


def data_files_of(recipe) -> list[str]:
    """The local data files a recipe reads (finetune and held-out), globs expanded; missing ones are skipped here
    (the preflight names them)."""
    import glob

    files = []
    for spec in (recipe.finetune.data, recipe.validate.data):
        for pattern in spec.files or []:
            expanded = str(Path(pattern).expanduser())
            files += glob.glob(expanded, recursive=True) if glob.has_magic(expanded) else [expanded]
    return files
