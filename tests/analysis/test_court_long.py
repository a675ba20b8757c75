"""The long court's growth counts (issue 30) on real runs written by ``scalelab-train``.

The court_long experiment at tiny sizes (rl, 24 steps, native from 2^18 growing every 4 clean
steps: the scale climbs until the tiny policy's fp16 gradients overflow, backs off, and grows
again; 2 seeds) and the fp32 reference.
The scale each step ran at is read from ``trace.jsonl`` and checked against the other record of
the same runs: ``metrics.jsonl``'s train lines (``log_every=1``: the scale after ``update()``,
i.e. the next step's), and the events against GradScaler's rule re-stated here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from analysis.court.growth import events, growth_interval, trace_scales
from analysis.court.long import main
from tests.experiments.runs import TINY, cli

TINY_LONG = [*TINY["rl"], "train.steps=24", "train.lr_warmup=2", "train.log_every=1",
             "train.fidelity_every=0", "train.eval_every=0", "seed=0,1", "hydra/launcher=basic"]
INTERVAL = 4


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("court_long")
    for cells in (["strategy=native", "strategy.init_scale=262144.0",
                   f"strategy.growth_interval={INTERVAL}"], ["precision=fp32", "strategy=none"]):
        proc = cli("-m", "+experiment=court_long", *cells, *TINY_LONG, f"hydra.sweep.dir={out}",
                   timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def _native_runs(sweep: Path) -> list[Path]:
    runs = sorted((sweep / "rl" / "fp16-native").glob("seed*"))
    assert len(runs) == 2
    return runs


def _gradscaler(found_inf: list[bool], init: float, interval: int) -> list[float]:
    """torch.amp.GradScaler's update re-stated: the scale each step ran at."""
    scale, clean, out = init, 0, []
    for inf in found_inf:
        out.append(scale)
        if inf:
            scale, clean = scale * 0.5, 0
        else:
            clean += 1
            if clean == interval:
                scale, clean = scale * 2.0, 0
    return out


def test_the_trace_s_scales_are_the_runs_scales(sweep: Path) -> None:
    for run in _native_runs(sweep):
        train = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in train if r["kind"] == "train"]
        scales = trace_scales(run)
        assert len(scales) == len(train) == 24
        assert scales[1:] == [r["scale"] for r in train[:-1]]  # a line's scale: after update()
        assert scales == _gradscaler([r["skipped"] for r in train], 2.0 ** 18, INTERVAL)
        assert growth_interval(run) == INTERVAL


def test_growth_after_a_backoff_is_counted(sweep: Path) -> None:
    for run in _native_runs(sweep):
        scales = trace_scales(run)
        e = events(scales)
        ups = sum(b > a for a, b in zip(scales, scales[1:]))
        downs = sum(b < a for a, b in zip(scales, scales[1:]))
        assert (e.growths, e.backoffs) == (ups, downs)
        assert e.backoffs >= 1 and e.first_backoff is not None  # it climbed to where fp16 overflows
        assert e.growths_after_backoff >= 1 and e.first_regrowth > e.first_backoff
        assert scales[e.first_regrowth] == 2 * scales[e.first_regrowth - 1]


def test_the_long_page_is_written_from_the_runs(sweep: Path, tmp_path: Path) -> None:
    page = tmp_path / "court-long.md"
    assert main([str(sweep), "--page", str(page)]) == 0
    text = page.read_text()
    assert "4 runs of `rl`, 2 seeds, 24 steps" in text
    row = re.search(r"\| `native` \| 4 \| 2 \| [^\n]*", text)[0]
    assert "| 2 of 2 that backed off |" in row
    assert "Not run at this horizon" in text and "`megatron`" in text


def test_a_missing_directory_exits_2(tmp_path: Path) -> None:
    assert main([str(tmp_path / "nowhere"), "--page", str(tmp_path / "p.md")]) == 2
