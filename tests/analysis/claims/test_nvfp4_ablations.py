"""analysis/reproduce/claims/nvfp4_ablations.py: each verdict on hand-made runs, and the claim's
sweeps as the experiment composes them."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.reproduce.claims import CLAIMS
from analysis.reproduce.claims.base import ClaimRuns
from analysis.reproduce.claims.nvfp4_ablations import ABLATIONS, CLAIM, FULL, KEEP, evaluate
from analysis.words import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED
from tests.experiments.runs import compose_cfg

ARMS = [dict(FULL)] + [{**FULL, **change} for change, _ in ABLATIONS.values()]


def _runs(penalty: list[float], seeds: int = 10, noise: float = 0.001) -> ClaimRuns:
    """One run per (arm, seed); ``keep`` as the config holds it (a list); loss = base + penalty[arm]."""
    rng = np.random.default_rng(0)
    rows = []
    for i, arm in enumerate(ARMS):
        for seed in range(seeds):
            row = {**arm, KEEP: list(arm[KEEP]), "seed": seed, "status": "completed", "strategy": "native",
                   "final_eval_loss": 3.4 + 0.05 * np.sin(seed) + penalty[i] + noise * rng.standard_normal()}
            rows.append(row)
    return ClaimRuns(runs=pd.DataFrame(rows), runset=None)  # type: ignore[arg-type]


def test_each_ablation_that_costs_loss_is_reproduced_and_one_that_helps_is_not():
    findings = evaluate(_runs([0.0, 0.03, 0.02, 0.01, -0.02]))
    assert [f.verdict for f in findings] == [REPRODUCED, REPRODUCED, REPRODUCED, NOT_REPRODUCED]
    assert [round(f.estimate, 2) for f in findings] == [0.03, 0.02, 0.01, -0.02]
    assert "stochastic rounding" in findings[0].measure and "BF16" in findings[3].measure
    assert all(f.n == 10 for f in findings)


def test_no_difference_or_too_few_seeds_is_inconclusive():
    assert {f.verdict for f in evaluate(_runs([0.0] * 5, noise=0.0))} == {INCONCLUSIVE}  # every difference 0
    assert {f.verdict for f in evaluate(_runs([0.0, 0.1, 0.1, 0.1, 0.1], seeds=5))} == {INCONCLUSIVE}


@pytest.mark.parametrize("sweep", CLAIM.sweeps)
def test_every_sweep_composes_to_its_arm(sweep: tuple[str, ...]) -> None:
    assert CLAIM in CLAIMS
    cfg = compose_cfg("+experiment=repro_nvfp4_ablations", *sweep)
    b = cfg.precision.blocks
    arm = {"precision": cfg.precision.name, "precision.blocks.gradient.rounding": b.gradient.rounding,
           "precision.blocks.gradient.rht": b.gradient.rht, "precision.blocks.weight.block_dims": b.weight.block_dims,
           KEEP: tuple(b.keep)}
    assert arm in ARMS and b.activation.rht == b.gradient.rht
