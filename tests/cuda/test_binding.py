"""The binding module: dispatch from strategies.stats to the op, dispatch of every update op
(op or Python twin, one argument list), the plain-torch fallback with a one-time warning when
the extension cannot be built, and concurrent first builds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from strategies import binding, kernel_build, kernels
from strategies.stats import unscale_and_stats, unscale_and_stats_reference
from tests.cuda.gradients import assert_bits_equal, make_grads
from tests.cuda.samples import SAMPLES, TWINS

REPO = Path(__file__).resolve().parents[2]

FALLBACK_SCRIPT = textwrap.dedent(
    """
    import json, warnings, torch
    from strategies import kernels
    from strategies.stats import unscale_and_stats, unscale_and_stats_reference
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        g1 = [torch.tensor([1.0, 0.0, float("inf")]), torch.ones(5)]
        g2 = [t.clone() for t in g1]
        a = unscale_and_stats(g1, torch.tensor(0.5))
        b = unscale_and_stats_reference(g2, torch.tensor(0.5))
        unscale_and_stats([torch.ones(2)], torch.tensor(0.5))  # second call: no second warning
        twin_ran = []
        kernels.dispatch("max_ema_update_", lambda *a: twin_ran.append(len(a)),
                         *(torch.zeros(()) for _ in range(7)), 1.0, 0.5, 2.0, 0.5, 1, False, True, False)
        ok = not twin_ran
    same = all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("found_inf", "zeros", "subnormals", "numel"))
    msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    print(json.dumps({"available": kernels.available(), "same": same, "update_op_used": ok, "warnings": msgs}))
    """
)


def run_script(script: str, env_extra: dict[str, str], timeout: int = 600) -> dict:
    env = {**os.environ, **env_extra, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout,
                         cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_falls_back_with_one_warning_when_the_build_fails(tmp_path):
    out = run_script(FALLBACK_SCRIPT, {"CXX": str(tmp_path / "no-such-compiler"), "SCALELAB_EXT_DIR": str(tmp_path)})
    assert out["available"] is False and out["same"] is True and out["update_op_used"] is False
    assert len(out["warnings"]) == 1 and "plain-torch path" in out["warnings"][0]


def test_can_be_disabled_silently():
    """SCALELAB_KERNELS=0 is a choice, not a failure: plain-torch path, no warning."""
    out = run_script(FALLBACK_SCRIPT, {"SCALELAB_KERNELS": "0"})
    assert out["available"] is False and out["same"] is True and out["warnings"] == []


def test_sources_are_found_from_the_checkout():
    src = kernel_build.source_dir()
    assert (src / "ops.cpp").is_file() and (src / "include" / "scalelab_rules.h").is_file()
    assert list((src / "kernels").glob("*.cu")) and list((src / "cpu").glob("*.cpp"))


def test_build_directory_is_stable_and_holds_the_library(ops):
    d = kernel_build.build_directory()
    assert d == kernel_build.build_directory()
    assert (d / "scalelab_ops.so").is_file() or list(d.glob("scalelab_ops*.so"))


def test_stats_dispatches_to_the_op(ops):
    """strategies.stats.unscale_and_stats returns the fused op's result (its sums of squares
    are accurate to 1e-6 where the reference's are not, so the two paths are distinguishable)."""
    a = make_grads([200_000, 3], torch.float32, seed=11)
    b = make_grads([200_000, 3], torch.float32, seed=11)
    c = make_grads([200_000, 3], torch.float32, seed=11)
    inv = torch.tensor(0.3)
    got = unscale_and_stats(a, inv)
    direct = ops.unscale_and_stats(b, inv, [], 1)
    ref = unscale_and_stats_reference(c, inv)
    assert torch.equal(got.sumsq, direct[2])
    for x, y in zip(a, c):
        assert_bits_equal(x, y)
    assert torch.equal(got.absmax, ref.absmax) and torch.equal(got.zeros, ref.zeros)


def test_dispatch_declines_foreign_tensors(ops):
    """A dtype the op does not take sends dispatch to the Python twin, with the same arguments."""
    z64 = torch.zeros((), dtype=torch.float64)
    args = (*(z64,) * 7, 1.0, 0.5, 2.0, 0.5, 1, False, True, False)
    seen: list[tuple] = []
    kernels.dispatch("max_ema_update_", lambda *a: seen.append(a), *args)
    assert seen == [args]


def test_dispatch_declines_mixed_devices(ops):
    """Tensors on two devices (here a meta tensor among CPU ones) never reach the op."""
    args = list(SAMPLES["native_update_"][0]())
    args[3] = torch.empty((), device="meta")
    seen: list[tuple] = []
    kernels.dispatch("native_update_", lambda *a: seen.append(a), *args)
    assert len(seen) == 1


@pytest.mark.parametrize("op", sorted(TWINS))
def test_op_schema_is_the_twin_signature(ops, op):
    """Same parameter names, order and defaults in the op's schema and its Python twin, so one
    argument list serves both (dispatch)."""
    import inspect

    schema = getattr(ops, op).default._schema.arguments
    params = list(inspect.signature(TWINS[op]).parameters.values())
    assert [a.name for a in schema] == [p.name for p in params]
    for a, p in zip(schema, params):
        want = inspect.Parameter.empty if not a.has_default_value() else a.default_value
        assert p.default == want, (a.name, p.default, want)


@pytest.mark.parametrize("op", sorted(TWINS))
@pytest.mark.parametrize("case", range(3))
def test_dispatch_runs_the_op_and_it_equals_the_twin(ops, op, case):
    """dispatch runs the op (the twin is not called) and the op's result is the twin's, bit for
    bit, on the same argument list."""
    args, ref = SAMPLES[op][case](), SAMPLES[op][case]()
    called: list[int] = []
    kernels.dispatch(op, lambda *a: called.append(1), *args)
    assert not called
    TWINS[op](*ref)
    for a, r in zip(args, ref):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                               r.view(torch.int32) if r.dtype == torch.float32 else r), (a, r)


@pytest.mark.slow
def test_concurrent_first_builds_share_one_directory(tmp_path):
    """Two processes building into the same empty directory at once (pytest-xdist's first test
    on two workers): torch's file lock lets one build and the other load the result."""
    script = textwrap.dedent(
        """
        import json, torch
        from strategies import kernels
        g = [torch.arange(10.0)]
        st = torch.ops.scalelab.unscale_and_stats(g, torch.tensor(0.5), [], 1) if kernels.load() else None
        print(json.dumps({"ok": st is not None, "sumsq": None if st is None else st[2].item()}))
        """
    )
    env = {**os.environ, "SCALELAB_EXT_DIR": str(tmp_path / "ext"), "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=REPO) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    results = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert all(r["ok"] for r in results), [e[-2000:] for _, e in outs]
    assert results[0]["sumsq"] == results[1]["sumsq"] == sum((i * 0.5) ** 2 for i in range(10))


def test_stats_op_declines_other_dtypes_before_touching_values(ops):
    """A float64 gradient among float32 ones: the binding returns None (caller takes the
    plain-torch path) and no gradient was modified, because the op validates first."""
    a = [torch.ones(40_000), torch.tensor([4.0, 0.0], dtype=torch.float64)]
    assert kernels.unscale_and_stats(a, torch.tensor(0.5), None, 1) is None
    assert torch.equal(a[0], torch.ones(40_000)) and a[1].tolist() == [4.0, 0.0]


def test_a_twin_that_disagrees_with_the_schema_is_refused_at_its_first_bind(ops):
    """The twin's signature is the one source of the argument order; an op schema naming other
    arguments, or the same in another order, is a RuntimeError naming the op and both lists."""

    def swapped(scale, growth_tracker, hysteresis_tracker, found_inf, backoff_factor, growth_factor,
                growth_interval, hysteresis):
        pass

    def renamed(scale, tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
                growth_interval, hysteresis):
        pass

    for twin in (swapped, renamed):
        with pytest.raises(RuntimeError, match=r"^scalelab::native_update_: the op's schema arguments"):
            binding.check_schema("native_update_", twin)
    binding.check_schema("native_update_", TWINS["native_update_"])  # the real twin agrees
