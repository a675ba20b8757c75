"""Issue 22, claim 3: unit scaling (Blake, Orr, Luschi, ICML 2023) trains in fp16 and fp8 without
loss scaling at fp32 parity, where the standard model at S = 1 does not.

Runs: ``conf/experiment/repro_unit_scaling.yaml`` — the character GPT, standard
(``model.unit_scaled=false``) and unit-scaled (``true``, ``experiments/workloads/unit_scaling.py``), each in
fp32, fp16 and simulated fp8-E5M2 with no loss scale (``strategy=none``), plus the standard model
in fp16 with torch's dynamic GradScaler (``strategy=native``), 10 seeds paired. The measure is the
final evaluation loss (nats); the mechanism is read from the run telemetry: the share of
activation-gradient entries at the layer boundaries that are zero or below the format's smallest
normal (``act_zero_frac_mean + act_subnormal_frac_mean``, logged every 5 steps).
"""

from __future__ import annotations

from dataclasses import replace

import pandas as pd

from analysis.metrics import FINAL_EVAL_LOSS
from analysis.reproduce.claims.base import Claim, ClaimRuns, Finding, select_runs, direction, paired_values, parity

__all__ = ["CLAIM", "MARGIN", "evaluate"]

#: Parity margin on the final evaluation loss (nats): 0.02, ~0.7 % of the fp32 loss (~2.8) of
#: this workload, fixed before the low-precision arms were looked at.
MARGIN = 0.02

_PAPER_ABSTRACT = ("Blake et al. 2023, abstract: 'training BERT-Large in FP16 and then FP8 with no "
                   "degradation in accuracy'; user guide (graphcore-research/unit-scaling docs/"
                   "user_guide.rst): 'loss scaling is not required for unit-scaled models'")


def _arm(unit: bool, precision: str, strategy: str = "none") -> dict:
    return {"model.unit_scaled": unit, "precision": precision, "strategy": strategy}


def _with_underflow(runs: pd.DataFrame) -> pd.DataFrame:
    """``runs`` with ``underflow``: the run's mean share of boundary activation-gradient entries
    that are zero or subnormal (``act_zero_frac_mean + act_subnormal_frac_mean``)."""
    zero = pd.to_numeric(runs["act_zero_frac_mean"], errors="coerce")
    sub = pd.to_numeric(runs["act_subnormal_frac_mean"], errors="coerce")
    return runs.assign(underflow=zero + sub)


def _share(runs: pd.DataFrame, where: dict) -> str:
    """The mean ``underflow`` of the completed runs matching ``where``, as a percentage."""
    sel = select_runs(runs, where)
    vals = sel.loc[sel["status"] == "completed", "underflow"].dropna()
    return f"{vals.mean():.1%} of entries ({len(vals)} runs)" if len(vals) else "no telemetry"


def evaluate(runs: ClaimRuns) -> list[Finding]:
    """The findings of the claim (see the module docstring), in the order of the report."""
    r = _with_underflow(runs.runs)
    loss = f"{FINAL_EVAL_LOSS.label} ({FINAL_EVAL_LOSS.unit})"
    out = []
    for fmt, name in (("fp16", "fp16"), ("fp8_e5m2", "fp8-E5M2 (simulated)")):
        a, b = paired_values(r, _arm(True, fmt), _arm(True, "fp32"))
        out.append(parity(f"{loss}, unit-scaled {name} S=1 minus unit-scaled fp32", _PAPER_ABSTRACT, a, b, MARGIN,
                          f"unit-scaled model's activation gradients zero or subnormal: {_share(r, _arm(True, fmt))}"))
    for fmt, name in (("fp16", "fp16"), ("fp8_e5m2", "fp8-E5M2 (simulated)")):
        a, b = paired_values(r, _arm(False, fmt), _arm(False, "fp32"))
        out.append(direction(f"{loss}, standard {name} S=1 minus standard fp32", "Blake et al. 2023, abstract: "
                             "'Training in FP16 or the recently proposed FP8 formats ... can lack sufficient "
                             "range for out-of-the-box training'", a, b, "higher",
                             f"standard model's activation gradients zero or subnormal: {_share(r, _arm(False, fmt))}"))
    uu, su = paired_values(r, _arm(True, "fp16"), _arm(False, "fp16"), metric="underflow")
    out.append(direction("share of activation-gradient entries zero or fp16-subnormal (mean over logged steps "
                         "and boundaries), unit-scaled minus standard, fp16 S=1", "Blake et al. 2023, abstract: 'seeking "
                         "unit variance of all weights, activations and gradients at initialisation'; Fig. 1: "
                         "'no longer requiring a loss scale to control the scale of' the gradients", uu, su, "lower"))
    a, b = paired_values(r, _arm(True, "fp32"), _arm(False, "fp32"))
    f = parity(f"{loss}, unit-scaled fp32 minus standard fp32 (each at its own learning rate)",
               "Blake et al. 2023, abstract: existing models 'can be adapted to be "
               "unit-scaled ... with no degradation in accuracy' (Table 2: regular vs unit-scaled BERT)", a, b, MARGIN)
    if f.hi < -MARGIN:  # outside the margin on the favourable side: no cost, but not parity either
        f = replace(f, note=f.note + "; the unit-scaled model ended lower (better): no accuracy cost here")
    out.append(f)
    a, b = paired_values(r, _arm(False, "fp16", "native"), _arm(False, "fp32"))
    out.append(parity(f"{loss}, standard fp16 with dynamic loss scaling (GradScaler) minus standard fp32",
                      "Micikevicius et al. 2018 (the usual fix; the paper's 'loss scaling' baseline)", a, b, MARGIN))
    return out


CLAIM = Claim(
    name="unit_scaling",
    order=3,  # issue 22, item 3
    title="Unit scaling trains in FP16 and FP8 without loss scaling",
    source=("Blake, Orr, Luschi, 'Unit Scaling: Out-of-the-Box Low-Precision Training', ICML 2023 "
            "(arXiv 2303.11257); graphcore-research/unit-scaling, commit 299e560: unit_scaling/scale.py, "
            "functional.py (linear, gelu, layer_norm, embedding, residual_split/add, "
            "scaled_dot_product_attention, cross_entropy), _modules.py (TransformerLayer taus), "
            "constraints.py (gmean)"),
    claim=("A unit-scaled model (unit-variance weights, activations and gradients at init, scales "
           "outside the weights) trains in FP16 and FP8 with no loss scale and no accuracy loss "
           "against FP32, where a standard model needs loss scaling."),
    deviations=(
        "2-layer, 32-wide character GPT on the stdlib corpus, 60 steps, batch 16 x 16 tokens, on CPU; "
        "the paper trains BERT-Base/Large (pre-training then SQuAD fine-tuning) and character LMs on IPUs",
        "fp8 is simulated: forward in bf16 autocast, only activation gradients quantised to E5M2 at the "
        "layer boundaries (no cast scaling); the paper casts matmul inputs to FP8 E4M3/E5M2",
        "S=1 is strategy=none (the disabled GradScaler: no scale, no step skipped on overflow)",
        "scalelab's loss is the mean cross-entropy in fp32 (experiments/app/recipe.py); the unit-scaled model "
        "applies the library's cross-entropy gradient scale N*V/(V-1)^1/2 to its fp32 logits, equal to "
        "the library's sum-reduced scaled loss",
        "positions: a learned position embedding added to the token embedding as (tok+pos)/2^1/2 (the "
        "library's decoder has none); linears keep biases (grad scale batch^-1/2 as the library's)",
        "no gradient clipping and no weight decay for either model (neither is scale-free)",
        "learning rate per model from a 2-seed fp32 sweep: standard 1e-2 (of 3e-3, 1e-2, 3e-2), "
        "unit-scaled 0.1 (of 3e-3 ... 0.3); AdamW, warmup 4, cosine decay",
        "the paper's Table 2 numbers (SQuAD scores of regular and unit-scaled BERT) could not be read "
        "from this sandbox (only the abstract and the library were): its stated conclusions are quoted",
    ),
    evaluate=evaluate,
    sweeps=((), ("model.unit_scaled=false", "precision=fp16", "strategy=native")),
    quick=("train.steps=12", "train.log_every=6", "train.hist_every=0"),
    factors=("model.unit_scaled",),
)
