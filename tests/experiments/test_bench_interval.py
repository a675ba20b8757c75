"""The bench's interval of a median ratio (experiments.bench.common.median_interval): the
distribution-free order-statistic interval, checked against the classic rank tables and by its
coverage on a skewed distribution whose median is known."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from experiments.bench import steps
from experiments.bench.common import median_interval, paired_ratio, paired_ratio_interval


@pytest.mark.parametrize("n, ranks", [(6, (1, 6)), (10, (2, 9)), (20, (6, 15)), (61, (23, 39))])
def test_the_interval_is_the_order_statistics_of_the_rank_tables(n, ranks):
    """Ranks as in the classic tables of the sign-test interval for the median at 95 % (n = 10:
    the 2nd and 9th values; n = 20: the 6th and 15th)."""
    values = [float(v) for v in random.Random(n).sample(range(1000), n)]
    x = sorted(values)
    assert median_interval(values) == (x[ranks[0] - 1], x[ranks[1] - 1])


def test_too_few_rounds_give_no_interval():
    assert all(math.isnan(v) for v in median_interval([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert steps.interval_text({"ratio_lo": math.nan, "ratio_hi": math.nan}) == "-"


def test_the_interval_covers_the_true_median_at_least_as_often_as_promised():
    """Rounds from a skewed distribution (exponential, median ln 2): the 95 % interval of 61
    rounds holds the true median in about 96 % of 3000 repetitions (exact: 1 - 2 P(B <= 22))."""
    rng = random.Random(0)
    hits = sum(lo <= math.log(2) <= hi for lo, hi in
               (median_interval([rng.expovariate(1.0) for _ in range(61)]) for _ in range(3000)))
    exact = 1 - 2 * sum(math.comb(61, j) for j in range(23)) / 2.0**61
    assert exact >= 0.95
    assert abs(hits / 3000 - exact) < 0.015


def test_the_paired_interval_holds_the_paired_median_ratio():
    rng = random.Random(1)
    plain = [30 + rng.random() for _ in range(61)]
    attached = [p * (1.04 + 0.02 * rng.random()) for p in plain]
    lo, hi = paired_ratio_interval(attached, plain)
    assert lo <= paired_ratio(attached, plain) <= hi
    assert 1.04 <= lo < hi <= 1.06
    assert statistics.median(a / p for a, p in zip(attached, plain)) == paired_ratio(attached, plain)


def test_section_c_prints_each_ratio_with_its_interval():
    row = {"model": "mlp", "strategy": "layerwise", "plain_ms": 30.0, "attached_ms": 31.2, "extra_ms": 1.2,
           "ratio": 1.04, "ratio_lo": 1.031, "ratio_hi": 1.052, "rounds": 61}
    line = steps.format_hooks([row]).splitlines()[-1]
    assert line.split()[-3:] == ["1.040", "[1.031,", "1.052]"]


def _spy_children(monkeypatch) -> list[dict]:
    """The environments the bench's child interpreters get (``subprocess.run`` is shared: the
    kernel build calls it too, and passes through untouched)."""
    envs, real_run = [], steps.subprocess.run

    def run(*args, **kw):
        if args and "experiments.bench.steps" in args[0]:
            envs.append(kw["env"])
        return real_run(*args, **kw)

    monkeypatch.setattr(steps.subprocess, "run", run)
    return envs


def test_section_c_pools_rounds_from_fresh_processes(monkeypatch):
    """processes=2: each row holds both processes' rounds (2 x 2), both processes' own median
    ratios, and its pooled ratio is the paired median of those rounds; two processes more run under
    glibc's default heap settings (``ratio_default``), the first two with HOOK_MALLOC; the page says so."""
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "12345")  # a caller's own setting: not passed to the default runs
    envs = _spy_children(monkeypatch)
    rows = steps.bench_hooks(3, ("mlp",), processes=2)
    held, default = steps.HOOK_MALLOC, dict.fromkeys(steps.HOOK_MALLOC)
    assert [{k: e.get(k) for k in steps.HOOK_MALLOC} for e in envs] == [held, held, default, default]
    assert [r["strategy"] for r in rows] == list(steps.HOOKED)
    for r in rows:
        assert r["rounds"] == 4 and r["processes"] == 2 and len(r["process_ratios"]) == 2
        assert min(r["process_ratios"]) <= r["ratio"] <= max(r["process_ratios"])  # a pooled median lies between
        assert min(r["process_ratios_default"]) <= r["ratio_default"] <= max(r["process_ratios_default"])
        assert r["plain_ms"] > 0 and r["attached_ms"] > 0
    text = steps.format_hooks(rows)
    assert "2 fresh processes" in text and "glibc default" in text
    last = rows[-1]
    assert text.splitlines()[-1].split()[-5:] == [
        f"{min(last['process_ratios']):.3f}-{max(last['process_ratios']):.3f}",
        f"{last['faults_plain']:.0f}/{last['faults_attached']:.0f}", f"{last['ratio_default']:.3f}",
        f"{min(last['process_ratios_default']):.3f}-{max(last['process_ratios_default']):.3f}",
        f"{last['faults_plain_default']:.0f}/{last['faults_attached_default']:.0f}"]


def test_minor_faults_counts_this_threads_page_faults():
    """Touching 64 fresh pages of an anonymous mapping faults each once (the fault column's gauge)."""
    import mmap

    buf = mmap.mmap(-1, 64 * mmap.PAGESIZE)
    before = steps.minor_faults()
    for i in range(64):
        buf[i * mmap.PAGESIZE] = 1
    assert steps.minor_faults() - before >= 64
    buf.close()


def test_a_failed_pooled_process_is_one_clear_error():
    with pytest.raises(RuntimeError, match="bench \\(c\\): a pooled process failed"):
        steps.bench_hooks(1, ("no-such-model",), processes=2)


def test_section_c2_times_each_rule_against_the_plain_mlp():
    from experiments.bench import hook_host

    rows = hook_host.bench_hook_host(2, calls=3)
    assert [r["strategy"] for r in rows] == list(steps.HOOKED)
    for r in rows:
        assert r["plain_forward_us"] > 0 and r["plain_step_us"] > r["plain_forward_us"]
        assert r["extra_forward_us"] == r["forward_us"] - r["plain_forward_us"]
        assert r["extra_step_us"] == r["step_us"] - r["plain_step_us"]
        assert r["rounds"] == 2 and r["calls"] == 3
    text = hook_host.format_hook_host(rows)
    assert text.startswith("(c2)") and "2 rounds of 3 calls" in text and len(text.splitlines()) == 6 + len(rows)


def test_section_c3_times_each_boundary_op_against_its_reference():
    """(c3): every op on the normal input in the three dtypes, the histogram on the wide one too;
    the wide input spans 40 binades (so it exercises the histogram's scalar count); the page
    prints one line per row."""
    from experiments.bench import boundary_ops

    rows = boundary_ops.bench_boundary_ops(2, calls=2, n=4096)
    assert [(r["op"], r["dtype"], r["input"]) for r in rows] == [
        *[(op, dt, "normal") for dt in ("float32", "float16", "bfloat16")
          for op in ("grad_extremes", "boundary_rescale", "exponent_histogram")],
        *[("exponent_histogram", dt, "wide") for dt in ("float32", "float16", "bfloat16")]]
    for r in rows:
        assert r["op_us"] > 0 and r["reference_us"] > 0 and r["speedup"] > 0 and r["rounds"] == 2
    wide = boundary_ops.gradient("wide", torch.float32, 4096).abs().log2().floor()
    assert int(wide.max() - wide.min()) == 39
    text = boundary_ops.format_boundary_ops(rows)
    assert text.startswith("(c3)") and "2 calls" in text and len(text.splitlines()) == 6 + len(rows)


def test_section_e_held_runs_in_a_fresh_process_with_the_heap_held(monkeypatch):
    """held=True: (e) runs in one child interpreter given HOOK_MALLOC (its rows say so, the page too)."""
    envs = _spy_children(monkeypatch)
    rows = steps.bench_every(2, every=((1, 1.0), (4, 0.5)), block=1, held=True)
    assert len(envs) == 1 and all(envs[0][k] == v for k, v in steps.HOOK_MALLOC.items())
    assert [(r["strategy"], r["stats_every"], r["stats_layers"]) for r in rows] == [
        ("layerwise", 1, 1.0), ("layerwise_adaloss", 1, 1.0), ("underflow_target", 1, 1.0),
        ("underflow_target", 4, 0.5)]  # the layerwise rules take stats_layers = 1 only
    assert all(r["held"] and r["plain_ms"] > 0 and r["attached_ms"] > 0 for r in rows)
    assert "heap held" in steps.format_every(rows) and "heap held" not in steps.format_every(steps.bench_every(
        1, every=((1, 1.0),), block=1))
