"""What an exported repo holds and imports. The published files are the method's model module and what it imports,
transitively; each may import only torch, transformers, triton, the standard library and those files. A missing
sibling would not fail loudly: the modeling files fall back to the PyTorch twins when a kernel module does not
import."""

import ast
import sys

import pytest

from cca_convert import methods, published

THIRD_PARTY = {"torch", "transformers", "triton"}
# What each method's export shipped when the list was a table: the import walk must find exactly these.
SHIPPED = {
    "cca": {"cca_hf.py", "attention_hooks.py", "attention_cca.py", "cache_cca.py", "decode_graph.py", "cca_params.py",
            "cca_reference.py", "cca_triton.py", "cca_gluon.py", "gluon_parts.py", "cca_pool_triton.py",
            "cca_decode_triton.py", "rope_triton.py", "skinny_triton.py", "tma.py"},
    "dca": {"dca_hf.py", "attention_hooks.py", "decode_graph.py", "dca_params.py", "dca_reference.py", "dca_triton.py",
            "dca_gluon.py", "gluon_parts.py", "rope_triton.py", "skinny_triton.py", "tma.py"},  # (CUDA-graph decode:
    # decode_graph.py and its few-row products; Hopper prefill: the Gluon files; rope_triton.py: the family's RoPE in
    # the kernels' own rounding)
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_the_import_walk_finds_every_file_the_model_uses_and_nothing_else(name):
    paths = published.published_files(methods.get(name).module_file())
    assert {p.name for p in paths} == SHIPPED[name]
    assert paths[0].name == methods.get(name).module + ".py"  # the model module first: what users read


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_flat_files_import_only_torch_transformers_triton_and_siblings(name):
    paths = published.published_files(methods.get(name).module_file())
    siblings = {p.stem for p in paths}
    for path in paths:
        text = published.flat_source(path)
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                # ``from .x import y`` names sibling x; ``from . import x, z`` names siblings x and z
                modules = [node.module] if node.module else [a.name for a in node.names]
                for module in modules:
                    assert node.level == 1 and module in siblings, (
                        f"{path.name} imports .{module}, which the {name} export does not publish")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                for module in names:
                    root = module.split(".")[0]
                    assert root in THIRD_PARTY or root in sys.stdlib_module_names, (
                        f"{path.name} imports {module}: a published file may import only torch, transformers, "
                        "triton, the standard library and its siblings")


def test_flattening_rewrites_only_the_package_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from ..kernels.cca_triton import x\nfrom ..kernels import cca_gluon\n"
                      "    from ..kernels.tma import y  # indented\nfrom .cache_cca import z\ntext = 'from ..kernels.q import'\n")
    assert published.flat_source(source) == ("from .cca_triton import x\nfrom . import cca_gluon\n"
                                             "    from .tma import y  # indented\nfrom .cache_cca import z\n"
                                             "text = 'from ..kernels.q import'\n")


def test_a_published_file_importing_outside_its_package_is_refused(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from ...cca_convert import recipe\n")
    with pytest.raises(ValueError, match="imports only its own package"):
        published.imported_files(bad)


def test_the_family_class_is_the_exported_modules_class():
    from transformers import LlamaForCausalLM

    from cca_convert.families import FAMILIES
    from cca_convert.modeling.cca_hf import CCAModelMixin

    cls = published.family_class(FAMILIES["llama"], methods.get("cca"))
    assert cls.__name__ == "CCALlamaForCausalLM" and cls.__bases__ == (CCAModelMixin, LlamaForCausalLM)
    assert published.family_class(FAMILIES["llama"], methods.get("cca")) is cls  # one class per family and method
    source = published.modeling_source(FAMILIES["llama"], methods.get("cca"))
    assert "class CCALlamaForCausalLM(CCAModelMixin, LlamaForCausalLM):" in source
