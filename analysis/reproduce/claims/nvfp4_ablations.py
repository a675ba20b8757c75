"""Issue 31, claim 2: the NVFP4 pre-training recipe's parts are each needed (arXiv 2509.25149).

Runs: ``conf/experiment/repro_nvfp4_ablations.yaml`` — the character GPT in ``precision=nvfp4``
(every Linear's GEMM operands in E2M1 with E4M3 block scales times an fp32 tensor scale, TE's roles:
16 x 16 weight tiles, stochastic rounding of gradients, the random Hadamard transform on the
weight-gradient GEMM's operands, the LM head in bf16; ``experiments/workloads/block_linear.py``), and
the same with one part dropped: 10 seeds paired, torch's GradScaler (``native``) as the loss scaler.
Measure: the final evaluation loss, each ablation minus the full recipe, paired by seed.
"""

from __future__ import annotations

from analysis.metrics import FINAL_EVAL_LOSS
from analysis.reproduce.claims.base import Claim, ClaimRuns, Finding, direction, paired_values

__all__ = ["ABLATIONS", "CLAIM", "FULL", "evaluate"]

SR, RHT = "precision.blocks.gradient.rounding", "precision.blocks.gradient.rht"
WEIGHT_DIMS, KEEP = "precision.blocks.weight.block_dims", "precision.blocks.keep"

FULL = {"precision": "nvfp4", SR: "stochastic", RHT: True, WEIGHT_DIMS: 2, KEEP: ("head",)}
"""The full recipe (conf/precision/nvfp4.yaml); ``keep`` is read as a tuple."""

ABLATIONS = {
    "stochastic rounding of the gradients dropped (nearest)": ({SR: "nearest"}, (f"{SR}=nearest",)),
    "random Hadamard transform dropped (wgrad operands cast as they are)": (
        {RHT: False}, ("precision.blocks.activation.rht=false", f"{RHT}=false")),
    "1 x 16 weight blocks instead of 16 x 16 tiles": ({WEIGHT_DIMS: 1}, (f"{WEIGHT_DIMS}=1",)),
    "no layer in BF16 (the LM head cast to NVFP4 too)": ({KEEP: ()}, (f"{KEEP}=[]",)),
}
"""Each ablation: (how its runs differ from :data:`FULL`, the overrides of its sweep)."""

_PAPER = ("arXiv 2509.25149 (NVIDIA 2025), Sec. 4 and its ablations: a 12B model pre-trained on 10T tokens in "
          "NVFP4 matches FP8 only with all four - 2D (16 x 16) weight scaling, stochastic rounding of gradients, "
          "random Hadamard transforms on the Wgrad inputs and a few linear layers kept in BF16; removing any one "
          "of them worsens the loss")


def _keep_as_tuple(runs: ClaimRuns) -> None:
    if KEEP in runs.runs:
        runs.runs[KEEP] = runs.runs[KEEP].map(lambda v: tuple(v) if isinstance(v, (list, tuple)) else v)


def evaluate(runs: ClaimRuns) -> list[Finding]:
    """Final eval loss of each ablation minus the full recipe: the source says higher."""
    _keep_as_tuple(runs)
    loss = f"{FINAL_EVAL_LOSS.label} ({FINAL_EVAL_LOSS.unit})"
    out = []
    for what, (change, _) in ABLATIONS.items():
        a, b = paired_values(runs.runs, {**FULL, **change}, FULL)
        out.append(direction(f"{loss}, NVFP4 with {what} minus the full recipe", _PAPER, a, b, "higher"))
    return out


CLAIM = Claim(
    name="nvfp4_ablations",
    order=8,  # issue 31, claim 2
    title="NVFP4 pre-training: 2D weight blocks, stochastic rounding, the Hadamard transform and BF16 layers each needed",
    source=("NVIDIA, 'Pretraining Large Language Models with NVFP4', arXiv:2509.25149, 2025; "
            "NVIDIA/TransformerEngine transformer_engine/common/recipe/__init__.py (NVFP4BlockScaling: "
            "disable_2d_quantization, disable_stochastic_rounding, disable_rht) and "
            "docs/features/low_precision_training/nvfp4"),
    claim=("Pre-training in NVFP4 (E2M1 values, an E4M3 scale per 16 elements times an fp32 tensor scale) "
           "reaches FP8's loss only with 16 x 16 weight blocks, stochastic rounding of the gradients, a 16-point "
           "random Hadamard transform on the weight-gradient GEMM's inputs and some layers in BF16; each "
           "removed alone raises the loss."),
    deviations=(
        "a 2-layer, 32-wide character GPT trained 40 steps at batch 16, not a 12B model on 10T tokens; the "
        f"measure is the {FINAL_EVAL_LOSS.label} on 4 x 128 sequences",
        "simulated NVFP4: operands quantised-dequantised by strategies.blocks.quantize (TE's formulas) and "
        "multiplied in fp32; embeddings, norms and attention products stay bf16",
        "the BF16 layers are the LM head only (the paper keeps about the last 15% of the blocks' linear layers "
        "and never quantises the head); the ablation casts the head too",
        "the RHT signs are TE's fixed sign vector; the ablation drops it from both wgrad operands",
        "CPU cost: 50 runs, 209 s of CPU in all (`/usr/bin/time scalelab-reproduce --claims nvfp4_ablations`: "
        "209.5 s user, children included; 13.5 min wall on 2 cores shared with other jobs)",
    ),
    evaluate=evaluate,
    sweeps=((), *(sweep for _, sweep in ABLATIONS.values())),
    quick=("train.steps=10", "train.batch_size=8"),
    factors=(SR, RHT, WEIGHT_DIMS, KEEP),
)
