"""The gradient-fidelity-over-steps figure: drawn per workload × precision from fidelity lines,
absent for runs without them."""

from __future__ import annotations

from pathlib import Path

from analysis import figures as F
from analysis.load import load_runs
from tests.analysis.synth import SweepSpec, write_sweep


def test_fidelity_curves_per_cell_with_bands_and_symlog(tmp_path: Path):
    write_sweep(tmp_path / "s", SweepSpec(seeds=3, steps=20, extras=True, fidelity_every=5,
                                          precisions=("fp16", "bf16")))
    rs = load_runs(tmp_path / "s")
    with F.figure_rc():
        figs = F.fidelity_curve_figures(rs)
    try:
        assert [f.name for f in figs] == ["fidelity-mlp-synthetic-plain-bf16",
                                          "fidelity-mlp-synthetic-plain-fp16"]
        lost, cos = figs[0].fig.axes[:2]
        # lost fractions from 1e-4 (max_ema) to 0.9 (none): symlog, 0 stays on the axis
        assert lost.get_yscale() == "symlog" and cos.get_yscale() == "symlog"
        labels = {t.get_text() for t in lost.get_legend().get_texts()}
        assert labels == {"layerwise", "max_ema", "native", "none"}
        assert lost.collections  # the bands over seeds
        assert "lost gradient entries: symlog" in figs[0].caption
        path = F.save(figs[0], tmp_path)
        assert path is not None and path.read_bytes()[:4] == b"\x89PNG"
    finally:
        F.close_all(figs)


def test_no_fidelity_lines_no_figure(sweep):
    root, _ = sweep
    rs = load_runs(root)
    assert rs.fidelity.empty
    assert F.fidelity_curve_figures(rs) == []
    assert not [f for f in F.all_figures(rs, rs.runs.iloc[0:0]) if f.name.startswith("fidelity")]


def test_every_cell_of_the_default_comparison_gets_its_paired_figure():
    """Seven cells below fp32 (bf16 controls sort first and have no `native`): none is cut off,
    and the control cells, with nothing to pair, draw none."""
    import pandas as pd

    from analysis.figures.paired import paired_difference_figures

    rows = []
    for regime in ("plain", "spikes", "tiny_grad"):
        for prec, arms in (("bf16", ["none"]), ("fp16", ["native", "max_ema", "none"]), ("fp32", ["none"])):
            for strategy in arms:
                for seed in range(3):
                    rows.append(dict(workload=f"gpt/c/{regime}", precision=prec, strategy=strategy, seed=seed,
                                     status="completed", final_primary=3.0 + 0.1 * seed + 0.01 * len(strategy)))
    for strategy in ("native", "max_ema"):
        for seed in range(3):
            rows.append(dict(workload="gpt/c/plain", precision="fp8_e5m2", strategy=strategy, seed=seed,
                             status="completed", final_primary=3.0 + seed))
    names = sorted(f.name for f in paired_difference_figures(pd.DataFrame(rows)))
    assert names == sorted(["paired-gpt-c-plain-fp16", "paired-gpt-c-plain-fp8-e5m2", "paired-gpt-c-spikes-fp16",
                            "paired-gpt-c-tiny-grad-fp16"])
    assert F.MAX_PER_KIND >= 7
