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

# Copied into every exported repo of a method, in this order (modeling first: it is what users read), beside the
# family's generated modeling_<method>_<model_type>.py. modeling_cca.py/configuration_cca.py (the first releases'
# Llama/Qwen2-only model_type "cca") are no longer exported; they stay as the reference the CCA shim is tested against.
METHOD_FILES = {
    "cca": {
        "cca_hf.py": MODELING_DIR,
        "attention_hooks.py": MODELING_DIR,
        "attention_cca.py": MODELING_DIR,
        "cache_cca.py": MODELING_DIR,
        "decode_graph.py": MODELING_DIR,
        "cca_reference.py": KERNELS_DIR,
        "cca_triton.py": KERNELS_DIR,
        "cca_gluon.py": KERNELS_DIR,
        "cca_pool_triton.py": KERNELS_DIR,
        "cca_decode_triton.py": KERNELS_DIR,
        "skinny_triton.py": KERNELS_DIR,
        "tma.py": KERNELS_DIR,
    },
    "dca": {
        "dca_hf.py": MODELING_DIR,
        "attention_hooks.py": MODELING_DIR,
        "dca_reference.py": KERNELS_DIR,
        "dca_triton.py": KERNELS_DIR,
        "tma.py": KERNELS_DIR,
    },
}
# What the generated file says and imports, per method: (title, shim module, mixin class)
METHODS = {
    "cca": ("Core Context Aware attention", "cca_hf", "CCAModelMixin",
            "whose full attention layers run CCA (cca_hf.py says how; everything else is the stock model)"),
    "dca": ("Dual Chunk Attention", "dca_hf", "DCAModelMixin",
            "whose attention layers run DCA's chunked RoPE positions (dca_hf.py says how; everything else is the "
            "stock model)"),
}


def published_paths(method: str = "cca") -> list[Path]:
    """Paths of the published files of ``method`` that exist in this build."""
    return [folder / name for name, folder in METHOD_FILES[method].items() if (folder / name).exists()]


def modeling_source(family, method: str = "cca") -> str:
    """The exported ``modeling_<method>_<model_type>.py`` of a ``families.Family`` row: the stock class with the
    method's mixin in front."""
    title, shim, mixin, what = METHODS[method]
    cls = family.class_name(method)
    return f'''"""{family.names} with {title}: transformers' own {family.causal_lm},
{what}."""

from transformers import {family.causal_lm}

from .{shim} import {mixin}


class {cls}({mixin}, {family.causal_lm}):
    pass


__all__ = ["{cls}"]
'''


def write_code(folder: Path, family, method: str = "cca") -> None:
    """The method's published files plus the family's modeling file, into an export folder."""
    for path in published_paths(method):
        shutil.copyfile(path, folder / path.name)
    (folder / f"{family.module_name(method)}.py").write_text(modeling_source(family, method))


def family_class(family, method: str = "cca") -> type:
    """The family's class for ``method``, from exactly the source its exported repo gets."""
    module_name = family.module_name(method)
    name = f"{PACKAGE}.{module_name}"
    if name not in sys.modules:
        load(METHODS[method][1])  # the package and the shim first
        module = types.ModuleType(name)
        module.__package__ = PACKAGE
        exec(compile(modeling_source(family, method), f"<{module_name}.py>", "exec"), module.__dict__)
        sys.modules[name] = module
    return getattr(sys.modules[name], family.class_name(method))


def load(module: str) -> types.ModuleType:
    """Import a published file (e.g. ``"modeling_cca"``) as users' transformers would."""
    if PACKAGE not in sys.modules:
        pkg = types.ModuleType(PACKAGE)
        pkg.__path__ = [str(MODELING_DIR), str(KERNELS_DIR)]
        sys.modules[PACKAGE] = pkg
    return importlib.import_module(f"{PACKAGE}.{module}")
