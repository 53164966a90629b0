"""The ``validate:`` recipe section: held-out data, context lengths, passkey, speed and gates."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from ..data import TextSource
from ..schema import Section
from .tasks import TASKS

class HeldoutData(TextSource):
    """Held-out text: the same schema and loader as ``finetune.data`` (``cca_convert.data``): local files
    (txt, jsonl, json, parquet, globs) or a ``datasets`` id. It must not overlap the finetune data: the same
    file (path or content) or the same dataset + config + split is refused."""

    split: str = "test"
    streaming: bool = Field(True, description="stream the dataset: only the documents needed are read")
    max_documents: int | None = Field(None, ge=1, description="documents read at most (default: every document of "
                                                              "local files, 64 of a Hub dataset)")


class LmEvalSection(Section):
    """lm-eval-harness tasks run on the base and the converted model (``pip install "cca-convert[eval]"``)."""

    tasks: list[str] = Field(default_factory=list, description="lm-eval task names (none: lm-eval is not run)")
    include_path: str | None = Field(None, description="a folder of task YAMLs (local tasks, no download)")
    limit: int | None = Field(None, ge=1, description="documents per task at most")
    num_fewshot: int | None = Field(None, ge=0)
    batch_size: int = Field(1, ge=1)


class ValidateSection(Section):
    enabled: bool = True
    data: HeldoutData = HeldoutData()
    context_lengths: list[int | str] = Field(
        default_factory=lambda: [4096, 8192, 16384, 32768],
        description="perplexity / passkey / speed lengths: tokens, or relative to the base's trained context c "
                    "(\"c\", \"8c\", \"c/4\"), resolved when the model is known")
    windows: int = Field(4, ge=1, le=100_000, description="perplexity windows per length (at most; evenly spread)")
    stride: int | None = Field(None, ge=1, description="distance between candidate window starts (default: the length, "
                                                          "i.e. non-overlapping windows)")
    batch_size: int = Field(1, ge=1, description="sequences per forward pass")
    passkey_depths: list[float] = Field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9],
                                        description="where the pass key sits in the filler (0 = start, 1 = end)")
    passkey_trials: int = Field(1, ge=0, le=10_000, description="random keys per depth and length (0: no passkey check)")
    passkey_digits: int = Field(5, ge=1, le=12)
    tasks: list[Literal[TASKS]] = Field(default_factory=list, description="RULER-style tasks scored by greedy decoding "
                                        "at every length, base and converted: " + ", ".join(TASKS))
    task_samples: int = Field(4, ge=1, le=10_000, description="prompts per task and length (the needle tasks: at "
                                                              "evenly spread depths)")
    lm_eval: LmEvalSection = LmEvalSection()
    speed: bool = Field(True, description="time one prefill and its peak memory, base vs the converted model, at "
                                          "each length")
    speed_repeats: int = Field(1, ge=1, description="timed prefills per length and model (after one warm-up)")
    seed: int = 0
    # Gates, against the final converted model (after the finetune when there is one); null turns a gate off.
    max_ppl_ratio: float | None = Field(1.10, gt=0, description="converted ppl / base ppl, at every length")
    max_ppl_growth: float | None = Field(None, gt=0, description="converted ppl at each length past the trained "
                                                                  "context / its ppl at the trained context (DCA)")
    min_passkey_accuracy: float | None = Field(None, ge=0, le=1,
                                               description="converted passkey accuracy, at every length")
    max_passkey_drop: float | None = Field(None, ge=0, le=1,
                                           description="base accuracy - converted accuracy, at every length")
    max_task_drop: float | None = Field(None, ge=0, le=1, description="base score - converted score, per task and "
                                                                        "length")

    @field_validator("context_lengths")
    @classmethod
    def _lengths(cls, v):
        if not v:
            raise ValueError("give at least one context length")
        for n in v:
            if isinstance(n, str) and not RELATIVE.fullmatch(n.strip()):
                raise ValueError(f"{n!r} is not a length: give tokens (4096) or a multiple of the trained context "
                                 "c (\"c\", \"8c\", \"c/4\")")
        if any(isinstance(n, int) and n < 2 for n in v):
            raise ValueError("context lengths must be >= 2")
        if any(isinstance(n, int) and n > 2**24 for n in v):  # 16M tokens: past every model's context, a typo
            raise ValueError("context lengths must be <= 16777216 tokens")
        return sorted(set(v)) if all(isinstance(n, int) for n in v) else v

    @field_validator("passkey_depths")
    @classmethod
    def _depths(cls, v):
        if not v or any(not 0 <= d <= 1 for d in v):  # (NaN fails both comparisons)
            raise ValueError("passkey depths must be between 0 and 1 (at least one)")
        return v

    def resolved(self, trained_context: int) -> "ValidateSection":
        """A copy with relative lengths ("8c", "c/4") turned into tokens of a base trained at ``trained_context``."""
        if all(isinstance(n, int) for n in self.context_lengths):
            return self
        lengths = [n if isinstance(n, int) else relative_length(n, trained_context) for n in self.context_lengths]
        return self.model_copy(update={"context_lengths": sorted(set(lengths))})


RELATIVE = re.compile(r"(\d+)?c(/(\d+))?")


def relative_length(text: str, trained_context: int) -> int:
    m = RELATIVE.fullmatch(text.strip())
    return max(2, int(m.group(1) or 1) * trained_context // int(m.group(3) or 1))
