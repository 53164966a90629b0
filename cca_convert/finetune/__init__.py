"""Finetuning a converted CCA model (the pipeline's ``finetune`` stage).

``config.FinetuneSection`` is the recipe's ``finetune:`` section; ``trainer.stage_finetune`` the stage;
``data`` turns a ``datasets`` spec into packed, resumable training sequences. Importing this package
is cheap (torch, datasets and peft load when the stage runs).
"""

from .config import FinetuneSection


def stage_finetune(job, on_step=None) -> None:
    from .trainer import stage_finetune as run

    run(job, on_step=on_step)


__all__ = ["FinetuneSection", "stage_finetune"]
