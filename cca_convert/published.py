"""The files published verbatim into every converted repo, and how cca_convert imports them.

``modeling/`` and ``kernels/`` live side by side in the source tree, but a published repo is flat
(transformers' remote-code loader resolves only ``from .sibling import x``). To run exactly the code
users will run, we import both folders as ONE virtual package whose ``__path__`` spans them, so the
files' relative imports resolve here just as they do in a Hub repo.
"""

import importlib
import shutil
import sys
import types
from pathlib import Path

try:  # installed: pyproject maps modeling/ and kernels/ to cca_convert.modeling / cca_convert.kernels
    from . import kernels as _kernels_pkg
    from . import modeling as _modeling_pkg

    MODELING_DIR = Path(_modeling_pkg.__file__).parent
    KERNELS_DIR = Path(_kernels_pkg.__file__).parent
except ImportError:  # a source checkout on PYTHONPATH, not installed
    MODELING_DIR = Path(__file__).resolve().parent.parent / "modeling"
    KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"
PACKAGE = "cca_convert._published"

# Copied into every exported repo, in this order (modeling first: it is what users read), beside the family's
# generated modeling_cca_<model_type>.py. modeling_cca.py/configuration_cca.py (the first releases' Llama/Qwen2-only
# model_type "cca") are no longer exported; they stay as the reference the shim is tested against.
PUBLISHED_FILES = {
    "cca_hf.py": MODELING_DIR,
    "attention_hooks.py": MODELING_DIR,
    "attention_cca.py": MODELING_DIR,
    "cache_cca.py": MODELING_DIR,
    "cca_reference.py": KERNELS_DIR,
    "cca_triton.py": KERNELS_DIR,
    "cca_pool_triton.py": KERNELS_DIR,
    "cca_decode_triton.py": KERNELS_DIR,
}


def published_paths() -> list[Path]:
    """Paths of the published files that exist in this build."""
    return [folder / name for name, folder in PUBLISHED_FILES.items() if (folder / name).exists()]


def modeling_source(family) -> str:
    """The exported ``modeling_cca_<model_type>.py`` of a ``families.Family`` row: the stock class with CCA's
    mixin in front."""
    return f'''"""{family.names} with Core Context Aware attention: transformers' own {family.causal_lm}, whose full
attention layers run CCA (cca_hf.py says how; everything else is the stock model)."""

from transformers import {family.causal_lm}

from .cca_hf import CCAModelMixin


class {family.cca_class}(CCAModelMixin, {family.causal_lm}):
    pass


__all__ = ["{family.cca_class}"]
'''


def write_code(folder: Path, family) -> None:
    """The published files plus the family's modeling file, into an export folder."""
    for path in published_paths():
        shutil.copyfile(path, folder / path.name)
    (folder / f"{family.module}.py").write_text(modeling_source(family))


def family_class(family) -> type:
    """The family's CCA class, from exactly the source its exported repo gets."""
    name = f"{PACKAGE}.{family.module}"
    if name not in sys.modules:
        load("cca_hf")  # the package and the shim first
        module = types.ModuleType(name)
        module.__package__ = PACKAGE
        exec(compile(modeling_source(family), f"<{family.module}.py>", "exec"), module.__dict__)
        sys.modules[name] = module
    return getattr(sys.modules[name], family.cca_class)


def load(module: str) -> types.ModuleType:
    """Import a published file (e.g. ``"modeling_cca"``) as users' transformers would."""
    if PACKAGE not in sys.modules:
        pkg = types.ModuleType(PACKAGE)
        pkg.__path__ = [str(MODELING_DIR), str(KERNELS_DIR)]
        sys.modules[PACKAGE] = pkg
    return importlib.import_module(f"{PACKAGE}.{module}")
