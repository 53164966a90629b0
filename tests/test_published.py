"""What an exported repo holds and imports. Every published file may import only torch, transformers, triton, the
standard library and siblings that the same method publishes. A missing sibling would not fail loudly: the modeling
files fall back to the PyTorch twins when a kernel module does not import."""

import ast
import sys

import pytest

from cca_convert import published

THIRD_PARTY = {"torch", "transformers", "triton"}


@pytest.mark.parametrize("method", sorted(published.METHOD_FILES))
def test_published_files_import_only_torch_transformers_triton_and_siblings(method):
    paths = published.published_paths(method)
    siblings = {p.stem for p in paths}
    assert len(paths) == len(published.METHOD_FILES[method]), "a published file is missing from the source tree"
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                # ``from .x import y`` names sibling x; ``from . import x, z`` names siblings x and z
                modules = [node.module] if node.module else [a.name for a in node.names]
                for module in modules:
                    assert node.level == 1 and module in siblings, (
                        f"{path.name} imports .{module}, which the {method} export does not publish")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                for name in names:
                    root = name.split(".")[0]
                    assert root in THIRD_PARTY or root in sys.stdlib_module_names, (
                        f"{path.name} imports {name}: a published file may import only torch, transformers, triton, "
                        f"the standard library and its siblings")
