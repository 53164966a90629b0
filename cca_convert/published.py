"""The code published verbatim into every converted repo, and how an export gets it.

``cca_convert.modeling`` (the model side) and ``cca_convert.kernels`` (attention kernels and their PyTorch twins) are
one real package: modeling's files import the kernels as ``from ..kernels.x import y``. A Hub repo is flat
(transformers' remote-code loader resolves only ``from .sibling import y``), so an export copies the files a method's
model imports, transitively, and rewrites ``..kernels.x`` to ``.x``. Nothing else ships.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

MODELING_DIR = Path(__file__).resolve().parent / "modeling"
KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
_FOLDERS = {"modeling": MODELING_DIR, "kernels": KERNELS_DIR}
_FLAT = re.compile(r"^(\s*from )\.\.(?:kernels|modeling)(?:\.(\w+))?( import )", re.MULTILINE)


def imported_files(path: Path) -> list[Path]:
    """The published files ``path`` imports (relative imports, those under ``try:`` included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        parts = node.module.split(".") if node.module else []
        if node.level == 1:
            folder = path.parent
        elif node.level == 2 and parts and parts[0] in _FOLDERS:
            folder, parts = _FOLDERS[parts[0]], parts[1:]
        else:
            raise ValueError(f"{path.name}:{node.lineno}: a published file imports only its own package's files")
        names = parts[:1] if parts else [alias.name for alias in node.names]
        out += [folder / f"{name}.py" for name in names]
    return out


@cache
def published_files(start: Path) -> tuple[Path, ...]:
    """A published module (``modeling/<module>.py``) and every published file it imports, transitively (modeling's
    first: what users read)."""
    seen, todo = [start], [start]
    while todo:
        for dep in imported_files(todo.pop(0)):
            if not dep.is_file():
                raise FileNotFoundError(f"{dep} (imported by a published file) is missing from this build")
            if dep not in seen:
                seen.append(dep)
                todo.append(dep)
    return tuple(sorted(seen, key=lambda p: p.parent == KERNELS_DIR))


def flat_source(path: Path) -> str:
    """A published file as a flat repo holds it: ``from ..kernels.x import`` becomes ``from .x import``."""
    return _FLAT.sub(lambda m: f"{m.group(1)}.{m.group(2) or ''}{m.group(3)}", path.read_text())


def modeling_source(family, method) -> str:
    """The exported ``modeling_<method>_<model_type>.py`` of a ``families.Family`` row: the stock class with the
    method's mixin in front (``family_class`` is the same class, built here)."""
    cls = family.class_name(method.name)
    return f'''"""{family.names} with {method.title}: transformers' own {family.causal_lm},
{method.what}."""

from transformers import {family.causal_lm}

from .{method.module} import {method.mixin_name}


class {cls}({method.mixin_name}, {family.causal_lm}):
    pass


__all__ = ["{cls}"]
'''


def write_code(folder: Path, family, method) -> None:
    """The method's published files, flattened, plus the family's modeling file, into an export folder."""
    for path in published_files(method.module_file()):
        (folder / path.name).write_text(flat_source(path))
    (folder / f"{family.module_name(method.name)}.py").write_text(modeling_source(family, method))


@cache
def family_class(family, method) -> type:
    """The family's class for ``method`` (a ``methods.Method``): what its exported
    ``modeling_<method>_<model_type>.py`` defines."""
    import transformers

    mixin = method.mixin()
    # __module__: transformers reads the class's module file (sys.modules) for attention heuristics; the mixin's
    # file is what the exported module imports, and like it defines no attention class of its own.
    return type(family.class_name(method.name), (mixin, getattr(transformers, family.causal_lm)),
                {"__module__": mixin.__module__, "__doc__": f"{family.causal_lm} with {method.title}."})
