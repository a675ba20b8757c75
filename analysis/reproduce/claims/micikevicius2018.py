"""Micikevicius et al. 2018, "Mixed Precision Training" (ICLR 2018), Sec. 3.2 and Fig. 3.

What the source says (Sec. 3.2; Fig. 3 is the histogram of activation-gradient values "collected
across all layers during FP32 training of Multibox SSD"): "much of the FP16 representable range was
left unused, while many values were below the minimum representable range and became zeros";
"values smaller than 2^-27 in magnitude were irrelevant to training of this network, whereas it
was important to preserve values in the [2^-27, 2^-24) range"; scaling by 8 (3 exponents) "was
sufficient to match the accuracy achieved with FP32 training", while SSD in fp16 without loss
scaling diverged (Sec. 4.2). Fig. 3's caption: 67 % of the values are zero, 2 % lie in
[2^-34, 2^-32) and 2 % in [2^-24, 2^-23). NVIDIA's "Training with Mixed Precision" user guide
(Sec. "Loss scaling to preserve small gradient magnitudes"; copied in godmoves/PhoenixGo
training/results/mixed_precision/README.md) gives the same histogram as 66.8 % zeros, "when
converted to FP16, 31 % of these values become zeros" (i.e. ~93 % of the 33.2 % nonzero values),
and a scale of 32K "would recover all but 0.1 % of values lost to 0 ... and still avoid overflow".

What scalelab measures, on two workloads with their natural gradients (``regime=plain``):

(a) from the fp32 runs, the share of nonzero activation-gradient values (``act_exp_hist``: every
    layer boundary, steps 10, 20, 30, 40 pooled) in the bands of ``floor(log2|g|)``: below 2^-27,
    [2^-27, 2^-24), [2^-24, 2^-14) (fp16 subnormal), [2^-14, 2^16) (fp16 normal; the sliver
    (65504, 2^16) counts here) and >= 2^16 (above 65504). One share per seed; the mean's 95 % BCa
    bootstrap interval over seeds is compared with a threshold on the claimed side (:func:`band`).
(b) final eval loss of fp16 at static S = 1, 8, 2^16 and dynamic (``native``) minus fp32, paired
    by seed: S = 1 higher (:func:`~analysis.reproduce.claims.base.direction`), the others at parity within a
    margin of half the fp32 seed-to-seed standard deviation (:func:`parity_margin`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

import numpy as np
import pandas as pd

from analysis.metrics import FINAL_EVAL_LOSS
from analysis.reproduce.claims.base import (MIN_PAIRS, Claim, ClaimRuns, Finding, direction,
                                            paired_values, parity, select_runs)
from analysis.stats import bootstrap_ci
from analysis.words import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED

__all__ = ["BANDS", "CLAIM", "band", "band_shares", "evaluate", "parity_margin"]

LOSS = FINAL_EVAL_LOSS.label

#: (label, lowest exponent, highest exponent + 1) of ``floor(log2|g|)``; ``None`` = unbounded.
BANDS: tuple[tuple[str, int | None, int | None], ...] = (
    ("below 2^-27", None, -27),
    ("[2^-27, 2^-24)", -27, -24),
    ("[2^-24, 2^-14) fp16 subnormal", -24, -14),
    ("[2^-14, 65504] fp16 normal", -14, 16),
    ("above 65504", 16, None),
)

#: The claim of each band: (what the source says, claimed side, threshold on the share of
#: nonzero values). Fig. 3's shares are of *all* values (67 % zeros): divided by the 33 % nonzero.
BAND_CLAIMS: dict[str, tuple[str, str, float]] = {
    "below 2^-24": ("Sec. 3.2: 'many values were below the minimum representable range and became "
                    "zeros'; NVIDIA guide: 31 % of all values (~93 % of the 33.2 % nonzero) become "
                    "zeros in fp16. Threshold ours: a large share = more than half the nonzero "
                    "values", "above", 0.5),
    "below 2^-27": ("Fig. 3: 2 % of all values in [2^-34, 2^-32) alone, i.e. >= 6 % of the nonzero "
                    "ones lie below 2^-27 (Sec. 3.2: irrelevant to training)", "above", 0.06),
    "[2^-27, 2^-24)": ("Sec. 3.2: 'important to preserve values in the [2^-27, 2^-24) range' "
                       "(qualitative; threshold ours: at least 1 % of the nonzero values)", "above", 0.01),
    "[2^-24, 2^-14) fp16 subnormal": ("Fig. 3: 2 % of all values in [2^-24, 2^-23) alone, i.e. >= 6 % "
                                      "of the nonzero ones", "above", 0.06),
    "[2^-14, 65504] fp16 normal": ("NVIDIA guide: 'only 5.3 %' of all values stay nonzero in fp16, "
                                   "i.e. at most 16 % of the nonzero ones are fp16-representable",
                                   "below", 0.16),
    "above 65504": ("Sec. 3.2: 'much of the FP16 representable range was left unused'; a 32K scale "
                    "still avoids overflow (NVIDIA guide). Threshold ours: below 0.1 %", "below", 0.001),
}

WORKLOADS = ("cnn_deep", "gpt")
GPT = ("model=gpt", "data=stdlib_chars", "model.n_layer=2", "model.n_embd=32", "data.block_size=16",
       "data.eval_batch_size=128")
FP32 = {"precision": "fp32"}


def band_shares(exp_hist: pd.DataFrame, run_ids: Sequence[str]) -> pd.DataFrame:
    """One row per run of ``run_ids``: the share of its nonzero histogram counts (all logged
    steps pooled) in each band of :data:`BANDS` and below 2^-24, plus ``zero_frac`` (exact zeros
    over all values). Runs without a histogram are left out."""
    rows = []
    for rid in run_ids:
        h = exp_hist[(exp_hist["run_id"] == rid) & exp_hist["exponent"].notna()]
        if h.empty:
            continue
        e, c = h["exponent"].to_numpy(dtype=float), h["count"].to_numpy(dtype=float)
        total = c.sum()
        if total <= 0:
            continue
        row = {"run_id": rid}
        for label, lo, hi in BANDS:
            keep = (e >= (-math.inf if lo is None else lo)) & (e < (math.inf if hi is None else hi))
            row[label] = float(c[keep].sum() / total)
        row["below 2^-24"] = row["below 2^-27"] + row["[2^-27, 2^-24)"]
        zeros = float(exp_hist[exp_hist["run_id"] == rid].groupby("step")["zeros"].first().sum())
        row["zero_frac"] = zeros / (zeros + total)
        rows.append(row)
    return pd.DataFrame(rows)


def band(measure: str, paper: str, shares: np.ndarray, claimed: str, threshold: float,
         note: str = "") -> Finding:
    """Mean of per-seed ``shares`` with its 95 % BCa bootstrap interval over seeds; the source
    says the share is ``claimed`` ("above" / "below") ``threshold``: the interval wholly on that
    side is **reproduced**, wholly on the other **not reproduced**, else (or with fewer than
    :data:`MIN_PAIRS` seeds) **inconclusive**."""
    if claimed not in ("above", "below"):
        raise ValueError(f"claimed must be 'above' or 'below', got {claimed!r}")
    x = np.asarray(shares, dtype=float)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return Finding(measure, paper, math.nan, math.nan, math.nan, 0, INCONCLUSIVE, note)
    lo, hi = bootstrap_ci(x, "mean")
    above, below = lo > threshold, hi < threshold
    if x.size < MIN_PAIRS or not (math.isfinite(lo) and math.isfinite(hi)):
        verdict = INCONCLUSIVE
    elif (above if claimed == "above" else below):
        verdict = REPRODUCED
    elif (below if claimed == "above" else above):
        verdict = NOT_REPRODUCED
    else:
        verdict = INCONCLUSIVE
    note = (note + "; " if note else "") + f"threshold {threshold:g} ({claimed})"
    return Finding(measure, paper, float(np.mean(x)), float(lo), float(hi), int(x.size), verdict, note)


def parity_margin(fp32_losses: np.ndarray) -> float:
    """Half the seed-to-seed standard deviation of the fp32 final eval loss (floor 1e-3): a
    paired difference smaller than that is below what changing the seed does to fp32 itself."""
    x = np.asarray(fp32_losses, dtype=float)
    x = x[np.isfinite(x)]
    sd = float(np.std(x, ddof=1)) if x.size > 1 else 0.0
    return max(0.5 * sd, 1e-3)


def _static(scale: float) -> dict:
    return {"precision": "fp16", "strategy": "static", "loss_scale": scale}


def _workload(runs: ClaimRuns, model: str) -> list[Finding]:
    sel = runs.runs[runs.runs["model"] == model]
    if sel.empty:
        return []
    fp32 = sel[(sel["precision"] == "fp32") & (sel["status"] == "completed")]
    shares = band_shares(runs.runset.exp_hist, list(fp32["run_id"]))
    out = []
    for label in ("below 2^-24", *[b[0] for b in BANDS]):
        paper, claimed, threshold = BAND_CLAIMS[label]
        vals = shares[label].to_numpy() if label in shares else np.array([])
        out.append(band(f"{model}: share of nonzero fp32 activation gradients {label}", paper, vals,
                        claimed, threshold))
    losses = fp32["final_eval_loss"].to_numpy(dtype=float)
    margin = parity_margin(losses)
    sd = np.std(losses, ddof=1) if losses.size > 1 else math.nan
    why = f"margin = half the fp32 seed-to-seed sd of {LOSS} ({sd:.3g})"
    s1_zero = _zero_frac(runs, sel, _static(1))
    fp32_zero = float(shares["zero_frac"].mean()) if "zero_frac" in shares else math.nan
    below = float(shares["below 2^-24"].mean()) if "below 2^-24" in shares else math.nan
    a, b = paired_values(sel, _static(1), FP32)
    s1 = direction(f"{model}: {LOSS}, fp16 S=1 minus fp32", "Sec. 4.2: SSD in fp16 "
                         "without loss scaling diverges", a, b, "higher",
                         note=f"fp32 puts {below:.2%} of nonzero activation gradients below 2^-24; exact "
                              f"zeros: {fp32_zero:.2%} in fp32, {s1_zero:.2%} in fp16 S=1")
    if -margin <= s1.lo and s1.hi <= margin:
        s1 = replace(s1, note=s1.note + f"; its interval lies inside the parity margin ±{margin:.3g} too")
    out.append(s1)
    for where, label, paper in ((_static(8), "fp16 S=8", "Sec. 3.2: scaling by 8 'was sufficient to "
                                 "match the accuracy achieved with FP32 training'"),
                                ({"precision": "fp16", "strategy": "native"}, "fp16 dynamic (native)",
                                 "Sec. 3.2: dynamic scaling by overflow checks (suggested); torch "
                                 "GradScaler"),
                                (_static(65536), "fp16 S=2^16", "Sec. 3.2: no downside to a large "
                                 "factor as long as it does not cause overflow (32K still avoids it)")):
        a, b = paired_values(sel, where, FP32)
        out.append(parity(f"{model}: {LOSS}, {label} minus fp32", paper, a, b, margin,
                          note=why + _skips(sel, where)))
    return out


def _zero_frac(runs: ClaimRuns, sel: pd.DataFrame, where: dict) -> float:
    ids = select_runs(sel, where)["run_id"]
    shares = band_shares(runs.runset.exp_hist, list(ids))
    return float(shares["zero_frac"].mean()) if "zero_frac" in shares else math.nan


def _skips(sel: pd.DataFrame, where: dict) -> str:
    arm = select_runs(sel, where)
    if arm.empty or "skipped_steps" not in arm:
        return ""
    skipped = pd.to_numeric(arm["skipped_steps"], errors="coerce")
    return f"; skipped (overflow) steps per run: mean {skipped.mean():.2g}, max {skipped.max():.0f}"


def evaluate(runs: ClaimRuns) -> list[Finding]:
    """Band shares (a) and the loss comparisons (b) of each workload present in ``runs``."""
    return [f for model in WORKLOADS for f in _workload(runs, model)]


_ARMS = ((), ("precision=fp32", "strategy=none", "loss_scale=1"), ("strategy=native", "loss_scale=65536"))

CLAIM = Claim(
    name="micikevicius2018",
    order=1,  # issue 22, item 1
    title="Mixed precision training: activation gradients below fp16's range, loss scale 8",
    source="Micikevicius, Narang, Alben, Diamos, Elsen, Garcia, Ginsburg, Houston, Kuchaiev, Venkatesh, "
           "Wu: 'Mixed Precision Training', ICLR 2018, Sec. 3.2 and Fig. 3; NVIDIA 'Training with Mixed "
           "Precision' user guide (loss-scaling section)",
    claim="In fp32 training a large share of activation-gradient values lies below fp16's range "
          "(they flush to zero in fp16); values in [2^-27, 2^-24) matter, smaller ones do not; a "
          "fixed scale of 8 restores fp32 accuracy where fp16 without scaling diverges.",
    deviations=(
        "Workloads: a 9-block plain CNN (no normalisation, 8..32 channels, conf/model/cnn_deep.yaml) on "
        "16x16 generated template images and a 2x32 character GPT, not Multibox SSD (VGG-D) on VOC",
        "40 steps of AdamW (lr 3e-3, warmup, cosine, clip 1.0) instead of full SGD training; the "
        f"outcome is {LOSS}, not mAP at convergence",
        "fp16 is CPU torch.autocast: only matmul/conv outputs are fp16; LayerNorm, softmax and the "
        "embedding keep fp32 activation gradients (the paper stores all activation gradients in fp16)",
        "The histogram pools steps 10-40 of each fp32 run at the model's layer-boundary outputs "
        "(convs.i, embed, blocks.i, ln_f, head), not every layer over the whole SSD training",
        "Band thresholds (more than half below 2^-24, etc.) are ours, derived from Fig. 3 and the "
        "NVIDIA guide's percentages of all values (67 % zeros) as stated per finding",
    ),
    evaluate=evaluate,
    sweeps=tuple(arm for wl in ((), GPT) for arm in ((*wl, *a) for a in _ARMS)),
    # --quick: 2 seeds x 5 steps, one eval batch (~70 CPU-s for the six sweeps, mostly process
    # start-up): every finding reads "inconclusive" (fewer than MIN_PAIRS seeds); it checks the plumbing.
    quick=("seed=0,1", "train.steps=5", "train.log_every=5", "train.hist_every=5", "train.eval_batches=1"),
    # --long: the GPT's three sweeps only; cnn_deep's 50 runs at 2400 steps would add ~1.5 h of CPU
    # (44 ms a step in its standard runs on this 2-core box, two jobs at once).
    long=("train.steps=2400", "train.lr_warmup=100", "train.log_every=50", "train.hist_every=600"),
    long_sweeps=tuple((*GPT, *a) for a in _ARMS),
    horizon=("The dynamic arm is torch's GradScaler (init 2^16, growth interval 2000): in 40 steps it can only "
             "back off, so without an overflow it is static 2^16 under another name. At 2400 steps (warm-up 100, "
             "cosine decay) it may double after 2000 clean steps and back off on the overflow that follows; "
             "and the fp32 histogram pools steps 600, 1200, 1800 and 2400, the whole course of training "
             "rather than its first 40 steps, as Fig. 3 pools SSD's training."),
    factors=("loss_scale",),
)
