"""Issue 22 item 6: the profiles claim — verdicts on hand-made runs, and the experiment end to
end at toy size."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from analysis.reproduce.claims import CLAIMS
from analysis.reproduce.claims.base import load_claim_runs
from analysis.reproduce.claims.profiles import CLAIM
from analysis.words import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, VERDICTS
from tests.analysis.profile_synth import claim_runs
from tests.experiments.runs import cli

INF = math.inf
WORKLOADS = ("gpt/c/plain", "gpt/c/tiny_grad", "gpt/c/spikes")


def _times(seeds: int, **rules: tuple[float, float]) -> dict:
    """native reaches the target at 22 (± 2 by seed) on every workload but tiny_grad (never);
    ``rule=(t_plain_and_spikes, t_tiny)`` gives another rule's times, with the same jitter."""
    jitter = [2 * (k % 2) for k in range(seeds)]
    out = {}
    for w in WORKLOADS:
        out[(w, "fp16", "native")] = [INF if "tiny" in w else 22 + j for j in jitter]
        for name, (easy, tiny) in rules.items():
            t = tiny if "tiny" in w else easy
            out[(w, "fp16", name)] = [t + j for j in jitter]
    return out


def _by_rule(runs) -> dict:
    return {f.measure.split(": ")[1].split(" minus")[0]: f for f in CLAIM.evaluate(runs)}


def test_verdicts_follow_the_paired_interval_of_b_minus_native():
    found = _by_rule(claim_runs(_times(10, rescues=(22, 26), slower=(60, INF),
                                       same=(22, INF))))
    assert found["rescues"].verdict == REPRODUCED and found["rescues"].lo > 0
    # tiny_grad solved at ratio 1 and the rest at par: B gains exactly 1/3 of the 3 workloads
    assert found["rescues"].estimate == pytest.approx(1 / 3)
    assert found["slower"].verdict == NOT_REPRODUCED and found["slower"].hi < 0
    assert found["same"].verdict == INCONCLUSIVE and found["same"].estimate == 0
    assert all(f.n == 10 and "native" in f.measure for f in found.values())
    assert "P(faster than native)" in found["rescues"].note


def test_fewer_than_ten_seeds_is_inconclusive_whatever_the_numbers():
    found = _by_rule(claim_runs(_times(5, rescues=(22, 26))))
    assert found["rescues"].verdict == INCONCLUSIVE and found["rescues"].lo > 0


def test_the_claim_is_registered_with_its_sweeps():
    assert CLAIM in CLAIMS and CLAIM.name == "profiles"
    assert ("precision=fp32", "strategy=none") in CLAIM.sweeps
    assert (Path(__file__).parents[3] / "conf/experiment/repro_profiles.yaml").exists()


@pytest.mark.slow
def test_the_experiment_runs_end_to_end_and_evaluates(tmp_path):
    """Every sweep of the claim at toy size (2 seeds, 8 steps, 2 rules, 2 fp16 regimes)."""
    toy = ["seed=0,1", "train.steps=8", "regime.spike_steps=[2,4,6]",
           "logger=none", f"hydra.sweep.dir={tmp_path}"]
    for extra in CLAIM.sweeps:
        narrow = [] if any(o.startswith("strategy=") for o in extra) else \
            ["strategy=native,max_ema"]
        if not any(o.startswith("regime=") for o in extra):
            narrow.append("regime=plain,tiny_grad")
        proc = cli("-m", "+experiment=repro_profiles", *extra, *narrow, *toy, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
    runs = load_claim_runs(tmp_path, CLAIM.factors)
    assert len(runs.runs) == 2 * 2 * 2 + 2 * 2 + 2 * 2
    findings = CLAIM.evaluate(runs)
    assert [f.measure.split(": ")[1] for f in findings] == ["max_ema minus native"]
    assert findings[0].verdict in VERDICTS and findings[0].n == 2
    assert "3 workloads" in findings[0].measure
