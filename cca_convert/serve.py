"""``cca-convert serve DIR_OR_REPO [transformers serve options]``: an OpenAI-compatible endpoint for an exported
model, through transformers' own server (``transformers serve``, FastAPI + Uvicorn).

transformers serve builds the model class from ``config.architectures[0]`` as an attribute of the ``transformers``
package, which a remote-code class (``CCALlamaForCausalLM``) is not: it fails before loading. This command loads
the repo's own class the way ``trust_remote_code`` does and hands it to transformers under that name (on
transformers >= 5.25, whose server loads the model in a spawned process, in that process: ``serve_loader``), then
runs transformers serve unchanged (its options pass through). Requests run ``generate()`` one at a time, the exported
model's own decode path (on CUDA: the compressed cache and CUDA-graph decode); continuous batching
(``--continuous-batching``) needs a paged cache, which CCA's compressed cache is not (docs/SERVING.md).
"""

from __future__ import annotations

import json
import os

from .errors import CCAError

USAGE = ("usage: cca-convert serve DIR_OR_REPO [transformers serve options, e.g. --port 8000 --device cuda:0]\n"
         "serves the exported model at http://localhost:8000/v1 (OpenAI-compatible: /v1/completions, "
         "/v1/chat/completions)")


def run_serve(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if "--continuous-batching" in argv:
        raise CCAError("--continuous-batching: transformers' continuous batching keeps a paged KV cache, which the "
                       "exported model's compressed cache is not; serve without it (docs/SERVING.md)")
    from .hub import resolve_source

    target, rest = argv[0], argv[1:]
    folder = resolve_source(target)
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        raise CCAError(f"{target}: no readable config.json; pass a folder or Hub repo exported by cca-convert") from None
    ref = (raw.get("auto_map") or {}).get("AutoModelForCausalLM")
    if not ref or not raw.get("architectures"):
        raise CCAError(f"{target} is not an exported model (its config.json has no auto_map): convert it first")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
        from transformers.cli.transformers import app
    except ImportError as exc:
        raise CCAError(f"serving needs transformers' server and its FastAPI/Uvicorn ({exc}): pip install "
                       "\"cca-convert[serve]\"") from None
    import transformers
    from transformers.cli.serving import model_manager
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    export = (raw["architectures"][0], ref, str(folder))
    # what transformers serve looks the class up as; transformers < 5.25 loads the model in this process
    setattr(transformers, export[0], get_class_from_dynamic_module(ref, str(folder)))
    if hasattr(model_manager, "ModelLoader"):  # >= 5.25: in a spawned one, with a copy of its loader
        from .serve_loader import ExportLoader

        ExportLoader.pending = export
        model_manager.ModelLoader = ExportLoader
    # transformers >= 5.25, where the `kernels` package is installed, swaps kernels it downloads from the Hub into a
    # model its server loads on a GPU (norms, RoPE, activations). Off unless the user asks (USE_HUB_KERNELS=YES): the
    # server runs the code the export was validated with, and starts offline. The spawned loader inherits it.
    os.environ.setdefault("USE_HUB_KERNELS", "NO")
    try:
        app(["serve", str(folder), "--trust-remote-code", *rest], prog_name="transformers")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


__all__ = ["run_serve"]
