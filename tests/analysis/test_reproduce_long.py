"""``scalelab-reproduce --long`` (analysis/reproduce/horizon.py): only claims that declare a horizon
run, with their ``long`` overrides, and the page sets each long-horizon verdict beside the
standard horizon's and says which changed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import analysis.reproduce.claims as registry
from analysis.reproduce import cli as reproduce
from analysis.reproduce.claims.base import Claim
from analysis.words import NOT_REPRODUCED, REPRODUCED
from tests.analysis.fake_claims import BROKEN, GOOD, SEEDS, evaluate_good
from tests.analysis.synth import TRUE_LOSS, SweepSpec, write_sweep

__all__: list[str] = []

LONG = ("train.steps=2400", "train.lr_warmup=100")
GOOD_LONG = dataclasses.replace(GOOD, long=LONG, horizon="the growth interval acts")


@pytest.fixture
def claims(monkeypatch: pytest.MonkeyPatch) -> list[Claim]:
    monkeypatch.setattr(registry, "CLAIMS", [GOOD_LONG, BROKEN])
    return [GOOD_LONG, BROKEN]


def test_a_claim_with_long_overrides_must_say_what_acts_there() -> None:
    with pytest.raises(ValueError, match="long and horizon go together"):
        Claim(name="x", title="t", source="s", claim="c", deviations=(), evaluate=evaluate_good, long=LONG)


def test_long_sweeps_add_the_claims_long_overrides_last() -> None:
    args = reproduce.sweep_args(GOOD_LONG, "runs/reproduce_long", quick=False, long=True)
    assert args == [["-m", "+experiment=repro_good", "hydra.sweep.dir=runs/reproduce_long/good", *sweep, *LONG]
                    for sweep in GOOD.sweeps]
    assert reproduce.sweep_args(GOOD_LONG, "o", quick=False) == reproduce.sweep_args(GOOD, "o", quick=False)


def test_long_sweeps_run_only_the_named_sweeps_under_long(tmp_path: Path) -> None:
    one = GOOD.sweeps[-1:]
    cut = dataclasses.replace(GOOD_LONG, long_sweeps=one)
    assert reproduce.sweep_args(cut, "o", quick=False, long=True) == [
        ["-m", "+experiment=repro_good", "hydra.sweep.dir=o/good", *one[0], *LONG]]
    assert reproduce.sweep_args(cut, "o", quick=False) == reproduce.sweep_args(GOOD, "o", quick=False)
    with pytest.raises(ValueError, match="long_sweeps needs long"):
        dataclasses.replace(GOOD, long_sweeps=one)


def test_the_long_page_names_the_sweeps_a_cut_claim_ran(monkeypatch, tmp_path: Path) -> None:
    cut = dataclasses.replace(GOOD_LONG, long_sweeps=GOOD.sweeps[-1:])
    monkeypatch.setattr(registry, "CLAIMS", [cut])
    long, doc = tmp_path / "long", tmp_path / "long.md"
    write_sweep(long / "good", SweepSpec(seeds=SEEDS))
    assert reproduce.main(["--long", "--report-only", "--out", str(long), "--baseline", str(tmp_path / "none"),
                           "--doc", str(doc)]) == 0
    text = doc.read_text(encoding="utf-8")
    assert f"**Sweeps at this horizon:** 1 of the claim's {len(GOOD.sweeps)}" in text
    assert " ".join(GOOD.sweeps[-1]) in text


def test_long_and_quick_together_are_refused(claims, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        reproduce.main(["--long", "--quick"])
    assert exc.value.code == 2 and "--long and --quick" in capsys.readouterr().err


def test_the_long_page_says_which_verdicts_changed(claims, tmp_path: Path, monkeypatch, capsys) -> None:
    """Standard horizon: max_ema 0.50 < native 0.70 (reproduced); long horizon: max_ema 0.90 >
    native 0.70 (the direction flips), the parity stays not reproduced."""
    short, long, doc = tmp_path / "short", tmp_path / "long", tmp_path / "docs" / "long.md"
    write_sweep(short / "good", SweepSpec(seeds=SEEDS))
    write_sweep(long / "good", SweepSpec(seeds=SEEDS, true_loss=dict(TRUE_LOSS, max_ema=0.90)))
    assert reproduce.main(["--long", "--report-only", "--out", str(long), "--baseline", str(short),
                           "--doc", str(doc)]) == 0
    text = doc.read_text(encoding="utf-8")
    assert "1 of 2 verdicts compared change at the long horizon." in text
    direction_row = next(line for line in text.splitlines() if line.startswith("| good | final eval loss, max_ema minus native | ")
                         and line.endswith(f"| yes: {REPRODUCED} → {NOT_REPRODUCED} |"))
    assert f"n {SEEDS}: {REPRODUCED}" in direction_row
    assert any(line.startswith("| good | ") and line.endswith("| no |") for line in text.splitlines())
    assert "they declare no `Claim.long`): `broken`." in text and "the growth interval acts" in text
    assert "train.steps=2400 train.lr_warmup=100" in text
    again = tmp_path / "again.md"
    reproduce.main(["--long", "--report-only", "--out", str(long), "--baseline", str(short), "--doc", str(again)])
    assert again.read_bytes() == doc.read_bytes()


def test_a_long_finding_without_a_standard_run_reads_as_not_compared(claims, tmp_path: Path) -> None:
    long, doc = tmp_path / "long", tmp_path / "long.md"
    write_sweep(long / "good", SweepSpec(seeds=SEEDS))
    assert reproduce.main(["--long", "--report-only", "--out", str(long), "--baseline", str(tmp_path / "none"),
                           "--doc", str(doc)]) == 0
    text = doc.read_text(encoding="utf-8")
    assert "0 of 0 verdicts compared change" in text
    assert all(line.endswith("| – |") for line in text.splitlines() if line.startswith("| good | final"))
