"""The files published verbatim into every converted repo, and how cca_convert imports them.

``modeling/`` and ``kernels/`` live side by side in the source tree, but a published repo is flat
(transformers' remote-code loader resolves only ``from .sibling import x``). To run exactly the code
users will run, we import both folders as ONE virtual package whose ``__path__`` spans them, so the
files' relative imports resolve here just as they do in a Hub repo.
"""

import importlib
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

# Copied into every exported repo, in this order (modeling first: it is what users read).
PUBLISHED_FILES = {
    "configuration_cca.py": MODELING_DIR,
    "modeling_cca.py": MODELING_DIR,
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


def load(module: str) -> types.ModuleType:
    """Import a published file (e.g. ``"modeling_cca"``) as users' transformers would."""
    if PACKAGE not in sys.modules:
        pkg = types.ModuleType(PACKAGE)
        pkg.__path__ = [str(MODELING_DIR), str(KERNELS_DIR)]
        sys.modules[PACKAGE] = pkg
    return importlib.import_module(f"{PACKAGE}.{module}")
