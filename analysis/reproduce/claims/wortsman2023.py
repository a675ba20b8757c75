"""Wortsman et al. 2023: attention-logit growth at high learning rates, and qk-layernorm, per loss
scaler (issue 22, item 5).

**Source.** M. Wortsman, P. J. Liu, L. Xiao, K. Everett, A. Alemi, B. Adlam, J. D. Co-Reyes,
I. Gur, A. Kumar, R. Novak, J. Pennington, J. Sohl-Dickstein, K. Xu, J. Lee, J. Gilmer,
S. Kornblith, "Small-scale proxies for large-scale Transformer training instabilities", ICLR 2024
(arXiv:2309.14322). Sec. 3.1.1: the attention logits grow at high learning rates even in small
models, the loss degrades, and qk-layernorm (LayerNorm on queries and keys) removes the growth
and lowers the LR sensitivity (their Fig. 1 and Fig. 4; figures only, no table of numbers).

**LR sensitivity** (their Sec. 2.2): for a learning algorithm ``A`` run at learning rates ``η``
of a sweep ``[a, b]`` with final loss ``ℓ(A(η))`` and ``ℓ0`` the loss at initialisation,

    LR sensitivity = E_η [ min(ℓ(A(η)), ℓ0) − min_η ℓ(A(η)) ]

(the expectation over the sweep's log-spaced rates; their sweep is 3e-4 to 3e-1). The clip at
``ℓ0`` keeps a diverged run from counting more than "learned nothing". :func:`lr_sensitivity` is
the formula; :func:`sensitivities` applies it to one arm's runs, one value per seed (a seed's
rates all share its init and data order), a diverged or stalled run's loss being ``+inf`` (so
``ℓ0`` after the clip).

**Here** (``conf/experiment/repro_wortsman2023.yaml``): a 1-layer character GPT with the logits
in their own module (``model=gpt_logit_growth``), rates 1e-2 … 1, without / with qk-layernorm,
under fp16 with torch's GradScaler (``native``) and with ``max_ema``, and under bf16 without
scaling. Findings per scaler: the LR sensitivity without minus with qk-layernorm (paired by
seed; the paper: higher); and for fp16, at the top rate, the skipped-step share and the
diverged-run share without minus with, and where the overflow starts (the doctor's first
overflowing module of each diverged run: ``blocks.<i>.scores`` is the attention logits
leaving fp16's range, 65504 — the runs record no logit maximum otherwise).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import pandas as pd

from analysis.metrics import SKIPPED_STEPS
from analysis.reproduce.claims.base import Claim, ClaimRuns, Finding, select_runs, direction, share
from analysis.words import INCONCLUSIVE

__all__ = ["ARMS", "CLAIM", "L0", "LR", "QK", "evaluate", "lr_sensitivity", "per_seed_metric",
           "sensitivities"]

LR, QK = "optimizer.lr", "model.qk_norm"
#: ``ℓ0``, the loss at initialisation: uniform prediction over the 256 byte values, ``ln 256``.
#: The GPT's head starts at std 0.02, so its first loss is within 0.02 of this
#: (``tests/analysis/claims/test_wortsman2023.py`` checks it in fp32).
L0 = math.log(256)
#: The scaler arms, (precision, strategy) -> the label of a finding.
ARMS = {("fp16", "native"): "fp16 GradScaler (native)", ("fp16", "max_ema"): "fp16 max_ema",
        ("bf16", "none"): "bf16, no scaling"}
FAILED = ("diverged", "stalled")
SCORES_SUFFIX = ".scores"

PAPER_SENS = ("qualitative (figures only): \"LR sensitivity measures the deviation from optimal "
              "performance when varying LR across orders of magnitude\" (Sec. 1); without "
              "qk-layernorm the loss degrades at high rates from attention-logit growth and "
              "qk-layernorm lowers the LR sensitivity (Sec. 3.1.1, Fig. 1; their runs are bf16)")
PAPER_FP16 = ("qualitative: the attention logits grow at high learning rates without qk-layernorm "
              "(Sec. 3.1.1; the paper runs bf16). That in fp16 (max 65504) the growth is an "
              f"overflow ({SKIPPED_STEPS.noun}, a diverged run) is issue 22's reading, not the paper's")


def lr_sensitivity(losses: Mapping[float, float], l0: float) -> float:
    """``mean over η of min(ℓ(η), ℓ0) − min over η of ℓ(η)`` (Wortsman et al. 2023, Sec. 2.2)
    for the final losses of one sweep, ``{η: ℓ(η)}``; a NaN loss counts as ``+inf`` (diverged)."""
    if not losses:
        raise ValueError("losses must hold at least one learning rate, got none")
    vals = np.array([math.inf if math.isnan(v) else float(v) for v in losses.values()])
    return float(np.mean(np.minimum(vals, l0)) - np.min(vals))


def _final_loss(run: pd.Series) -> float | None:
    """A run's final eval loss; ``+inf`` when it diverged or stalled; ``None`` when it has no
    result (failed, incomplete, or completed without a loss)."""
    if run["status"] in FAILED:
        return math.inf
    loss = run.get("final_eval_loss")
    if run["status"] != "completed" or loss is None or pd.isna(loss):
        return None
    return float(loss)


def sensitivities(runs: pd.DataFrame, where: Mapping[str, Any], l0: float = L0) -> pd.Series:
    """Per seed, :func:`lr_sensitivity` over the learning rates (column :data:`LR`) of the runs
    matching ``where``. A seed enters only with a result at every rate the arm ran (the rates of
    all its seeds together), and only when the arm ran at least two rates."""
    sel = select_runs(runs, where)
    rates = sorted({float(r) for r in sel[LR] if r is not None and not pd.isna(r)})
    if len(rates) < 2:
        return pd.Series(dtype=float)
    table: dict[int, dict[float, float]] = {}
    for _, run in sel.iterrows():
        loss = _final_loss(run)
        if loss is not None:
            table.setdefault(int(run["seed"]), {})[float(run[LR])] = loss
    out = {seed: lr_sensitivity(losses, l0) for seed, losses in table.items() if set(losses) == set(rates)}
    return pd.Series(out, dtype=float).sort_index()


def per_seed_metric(runs: pd.DataFrame, where: Mapping[str, Any], metric: str) -> pd.Series:
    """Per seed, for the runs matching ``where`` that ended (completed, diverged or stalled):
    ``"skip_share"`` = skipped steps / steps run, ``"failed"`` = 1.0 if it diverged or stalled
    else 0.0."""
    out = {}
    for _, run in select_runs(runs, where).iterrows():
        if run["status"] not in ("completed", *FAILED):
            continue
        if metric == "failed":
            out[int(run["seed"])] = float(run["status"] in FAILED)
        elif metric == "skip_share":
            steps, skipped = run.get("steps"), run.get("skipped_steps")
            if steps is None or skipped is None or pd.isna(steps) or pd.isna(skipped) or steps <= 0:
                continue
            out[int(run["seed"])] = float(skipped) / float(steps)
        else:
            raise ValueError(f"metric must be 'skip_share' or 'failed', got {metric!r}")
    return pd.Series(out, dtype=float).sort_index()


def _paired(a: pd.Series, b: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    seeds = sorted(set(a.index) & set(b.index))
    return a.loc[seeds].to_numpy(), b.loc[seeds].to_numpy()


def _arm(precision: str, strategy: str) -> dict[str, Any]:
    return {"precision": precision, "strategy": strategy}


def _sensitivity_finding(runs: pd.DataFrame, precision: str, strategy: str, label: str) -> Finding:
    where = _arm(precision, strategy)
    a, b = _paired(sensitivities(runs, {**where, QK: False}), sensitivities(runs, {**where, QK: True}))
    measure = f"{label}: LR sensitivity (ℓ0 = ln 256) without minus with qk-layernorm"
    if a.size == 0:
        return Finding(measure, PAPER_SENS, math.nan, math.nan, math.nan, 0, INCONCLUSIVE,
                       "no seed with results at two or more learning rates (--quick runs the top rate only)")
    note = f"mean sensitivity without {np.mean(a):.3f}, with {np.mean(b):.3f}"
    return direction(measure, PAPER_SENS, a, b, "higher", note)


def _top_findings(runs: pd.DataFrame, precision: str, strategy: str, label: str, top: float) -> list[Finding]:
    where = {**_arm(precision, strategy), LR: top}
    no, qk = {**where, QK: False}, {**where, QK: True}
    out = []
    for metric, what in (("skip_share", "skipped-step share"), ("failed", "diverged-or-stalled share")):
        a, b = _paired(per_seed_metric(runs, no, metric), per_seed_metric(runs, qk, metric))
        note = (f"without {np.mean(a):.3f}, with {np.mean(b):.3f}" if a.size else "no paired runs")
        if metric == "skip_share":
            note += "; a diverged run's share is over the steps it ran (it stops within 5 steps of the overflow)"
        out.append(direction(f"{label}, lr={top:g}: {what} without minus with qk-layernorm",
                             PAPER_FP16, a, b, "higher", note))
    failed = select_runs(runs, no)
    failed = failed[failed["status"].isin(FAILED)]
    modules = failed["diagnosis_module"] if "diagnosis_module" in failed else pd.Series(dtype=object)
    hits = int(sum(isinstance(m, str) and m.endswith(SCORES_SUFFIX) for m in modules))
    out.append(share(f"{label}, lr={top:g}, without qk-layernorm: share of diverged runs whose first "
                     f"overflow (scalelab-doctor) is the attention logits (blocks.*{SCORES_SUFFIX})",
                     "qualitative: the attention logits are what grows (Sec. 3.1.1)", hits, len(failed),
                     "above", 0.5, f"{hits} of {len(failed)} diverged runs"))
    return out


def evaluate(runs: ClaimRuns) -> list[Finding]:
    """Per scaler arm present: the LR-sensitivity finding; for fp16 arms also the top-rate
    skipped-step, diverged-run and overflow-location findings."""
    frame = runs.runs
    findings: list[Finding] = []
    for (precision, strategy), label in ARMS.items():
        arm = select_runs(frame, _arm(precision, strategy))
        if arm.empty:
            continue
        findings.append(_sensitivity_finding(frame, precision, strategy, label))
        if precision == "fp16":
            top = max(float(r) for r in arm[LR] if r is not None and not pd.isna(r))
            findings.extend(_top_findings(frame, precision, strategy, label, top))
    return findings


CLAIM = Claim(
    name="wortsman2023",
    order=5,  # issue 22, item 5
    title="Attention-logit growth at high learning rate and qk-layernorm, per loss scaler",
    source=("M. Wortsman, P. J. Liu, L. Xiao et al., \"Small-scale proxies for large-scale Transformer "
            "training instabilities\", ICLR 2024 (arXiv:2309.14322), Sec. 2.2 (LR sensitivity) and "
            "Sec. 3.1.1 (attention logit growth, qk-layernorm)"),
    claim=("Attention logits grow at high learning rates even in small Transformers and the final loss "
           "degrades; qk-layernorm removes the growth and lowers the LR sensitivity "
           f"E_η[min(ℓ(η), ℓ0) − min_η ℓ(η)]. In fp16 the growth shows as overflow: {SKIPPED_STEPS.noun}."),
    deviations=(
        "1-layer, 2-head, width-32 character GPT (256 bytes, context 16) for 40 steps of batch 16, "
        "not GPT-2-style models of 1e7-1e9 parameters on C4 for 1e5 steps",
        "learning rates 1e-2, 3e-2, 1e-1, 3e-1, 1 (this model's best rate is near 1e-2; the paper "
        "sweeps 3e-4 to 3e-1), 5 rates, not their finer sweep",
        "scalelab's nanoGPT recipe: AdamW betas (0.9, 0.99), weight decay 0.1 on matrices, clip 1.0, "
        "4 warmup steps then cosine to lr/10; the paper: betas (0.9, 0.95), independent weight decay "
        "1e-4, 5 % warmup, no biases, rotary embeddings, z-loss",
        "ℓ0 = ln 256 (uniform prediction), not each run's measured first loss (within 0.02 of it)",
        "the paper trains in bf16 without loss scaling; the fp16 arms (GradScaler, max_ema) are "
        "scalelab's extension, as the issue asks",
        "the runs do not record the maximum attention logit; a fp16 overflow of the logits is read "
        "from scalelab-doctor's first overflowing module of each diverged run",
        "final loss is the eval loss of 2 fixed batches of 64 x 16 characters",
    ),
    evaluate=evaluate,
    sweeps=((), ("precision=bf16", "strategy=none")),
    quick=("hydra.sweeper.params.strategy=native", "optimizer.lr=1.0"),
    factors=(LR, QK),
)
