"""How close each forward kernel's gradients are to fp32, over many tiny checkpoints: the model-level check of
``tests/finetune/test_model_training.py`` (``compare_training``: the worst trainable gradient's error against the fp32
reference, divided by its limit, ``2 x`` the bf16 reference's error ``+ 2e-2``), per model seed.

The test runs a few checkpoints per family; one draw of this statistic says little where it is heavy-tailed (qwen2:
its q/k biases and LoRA-A gradients sum dq/dk over every position). This script draws many, for the default call
(on an sm_90 GPU with triton 3.6: the Gluon forward) and for the same call with the Triton forward (the backward is
the default one in both), so the two forwards' accuracy is compared on a distribution, not on one draw.

    python benchmarks/gradient_sweep.py --families qwen2,qwen3 --seeds 16        # GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def triton_forward(enabled: bool):
    """Route the forward of every loaded ``cca_triton`` module (the model's published copy included) to its Triton
    kernel (``enabled``; the backward keeps its default kernels) or back to the default."""
    for name, module in list(sys.modules.items()):
        if not name.endswith("cca_triton") or not hasattr(module, "_forward"):
            continue
        default = module.__dict__.setdefault("_default_forward", module._forward)

        def forward(*args, _default=default, **kwargs):
            return _default(*args, **{**kwargs, "use_gluon": False})

        module._forward = forward if enabled else default


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="qwen2,llama,qwen3")
    ap.add_argument("--seeds", type=int, default=16, help="tiny checkpoints per family (model seeds 0..N-1)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gradient_sweep.py compares the GPU kernels: it needs a CUDA GPU")
    import tests.test_model_training as check  # the test's own models, batch and comparison

    batch = check.make_batch(4, 777, pad=True)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  bf16 autocast, batch 4 x 777, padded; "
          f"worst gradient's error / limit per model seed (above 1 fails the test's per-checkpoint limit)")
    for family in args.families.split(","):
        for lora in (False, True):
            ratios = {"default": [], "triton-fwd": []}
            for seed in range(args.seeds):
                model = check.make_model(8, 2, 64, g=8, s=128, pooling="kv", family=family, seed=seed)
                for name, ratio in ratios.items():
                    triton_forward(name == "triton-fwd")
                    try:
                        ratio.append(check.compare_training(model, batch, torch.bfloat16, "autocast", False, lora)[0])
                    finally:
                        triton_forward(False)
            for name, r in ratios.items():
                print(f"{family:8s} lora={int(lora)} {name:10s} mean {statistics.mean(r):.3f} max {max(r):.3f} "
                      f"over 1: {sum(x > 1 for x in r)}/{len(r)} | " + " ".join(f"{x:.2f}" for x in r), flush=True)


if __name__ == "__main__":
    main()
