"""The model loader of ``cca-convert serve`` on transformers >= 5.25, whose server loads the model in a process of
its own (``multiprocessing`` spawn): a class registered in the command's process is not there, so the loader
registers the export's remote-code class in the process that loads it. Imported only by ``serve`` on those
versions (older ones have no ``ModelLoader``)."""

from __future__ import annotations

import transformers
from transformers.cli.serving.model_manager import ModelLoader
from transformers.dynamic_module_utils import get_class_from_dynamic_module


def register_export_class(architecture: str, ref: str, folder: str) -> None:
    """Makes ``transformers.<architecture>`` the export's own class, which is where transformers serve looks the
    class of ``config.architectures[0]`` up."""
    setattr(transformers, architecture, get_class_from_dynamic_module(ref, folder))


class ExportLoader(ModelLoader):
    """transformers' loader, registering the export's class first in whichever process loads the model. The export
    (architecture, auto_map reference, folder) is an instance attribute, so it travels to the spawned process with
    the pickled loader."""

    pending: tuple[str, str, str] | None = None  # set by run_serve before transformers builds its loader

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.export = type(self).pending

    def load_model_and_processor(self, *args, **kwargs):
        if self.export is not None:
            register_export_class(*self.export)
        return super().load_model_and_processor(*args, **kwargs)


__all__ = ["ExportLoader", "register_export_class"]
