"""The ``finetune:`` section of a recipe."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ..data import TextSource
from ..schema import Section

# Learning rate used when ``finetune.learning_rate`` is left unset.
DEFAULT_LR = {"lora": 2e-4, "qkv": 5e-5, "full": 2e-5}
# Keys that do not change the training trajectory: a run may be resumed with other values.
RESUME_FREE_KEYS = {"enabled", "checkpoint_every", "log_every", "tensorboard"}


class LoraSection(Section):
    r: int = Field(16, ge=1, le=4096, description="LoRA rank")
    alpha: float = Field(32, gt=0, description="LoRA scaling numerator (scale = alpha / r)")
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | None = Field(
        None, min_length=1, description="modules to adapt (default: the family's q/k/v projections, e.g. qkv_proj)")
    save_adapter: bool = Field(True, description="also ship the unmerged adapter in the output's adapter/ folder")


class DataSection(TextSource):
    """The training text (see ``cca_convert.data.TextSource``) and how it is shuffled."""

    shuffle: bool = True
    shuffle_buffer: int = Field(10_000, ge=1, description="streaming: documents in the shuffle buffer")


class FinetuneSection(Section):
    enabled: bool = False
    method: Literal["lora", "qkv", "full"] = Field(
        "lora", description="lora: LoRA adapters (merged before export); qkv: train only q/k/v projections; full")
    lora: LoraSection = LoraSection()
    data: DataSection = DataSection()
    seq_len: int = Field(4096, ge=2, le=2**22, description="tokens per training sequence (at most 4M)")
    packing: bool = Field(True, description="concatenate documents with EOS and cut seq_len blocks (else truncate+pad)")
    micro_batch_size: int = Field(1, ge=1, le=65536, description="sequences per forward pass and process")
    gradient_accumulation_steps: int = Field(8, ge=1, le=1_000_000)
    # beyond ten million optimizer steps a value is a typo (1e20), not a plan: it would start a run that never ends
    steps: int = Field(1000, ge=1, le=10_000_000, description="optimizer steps (at most 10 million)")
    learning_rate: float | None = Field(None, gt=0, description="peak LR; default lora 2e-4, qkv 5e-5, full 2e-5")
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(20, ge=0, le=10_000_000)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final LR of cosine/linear decay, relative to the peak")
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = Field(1.0, ge=0, description="gradient clipping; 0 disables")
    bf16: bool | Literal["auto"] = Field("auto", description="bf16 autocast; auto = on for CUDA GPUs")
    gradient_checkpointing: bool = True
    seed: int = 0
    checkpoint_every: int = Field(100, ge=0, description="optimizer steps between checkpoints; 0 = only on SIGINT/SIGTERM")
    log_every: int = Field(1, ge=1, description="optimizer steps between metrics.jsonl lines")
    tensorboard: bool = Field(True, description="also log to TensorBoard when it is installed")

    @property
    def lr(self) -> float:
        return self.learning_rate if self.learning_rate is not None else DEFAULT_LR[self.method]

    @model_validator(mode="after")
    def _needs_data(self):
        if self.enabled and self.data.dataset is None and self.data.files is None:
            raise ValueError("finetune.enabled needs data: set finetune.data.files or finetune.data.dataset")
        return self

    def trajectory_dict(self) -> dict:
        """The settings that determine the training trajectory (compared on --resume)."""
        return {k: v for k, v in self.model_dump(mode="json").items() if k not in RESUME_FREE_KEYS}
