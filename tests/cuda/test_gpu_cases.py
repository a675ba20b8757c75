"""GPU cases the kernel tests of test_gpu.py / test_gpu_trajectories.py leave open (issue 24, item 4);
skipped without CUDA.

* the single-scale statistics path (one ``inv_scale`` for every group) against the plain-torch
  reference, with 1 and 3 groups;
* every strategy (registered rules and conf/strategy presets) reaches its op on CUDA: a few real
  fp16-autocast training steps with every Python twin and plain-torch fallback made to raise, then
  every state tensor and parameter compared bit for bit with the same run under
  ``SCALELAB_KERNELS=0`` (in a subprocess: the variable is read once, at the first load);
* every op of the library on a side stream whose inputs are written after ``torch.cuda._sleep``
  (the op must run on the current stream, so it waits for them) and captured in a
  ``torch.cuda.graph`` (replayed twice, equal to two eager calls);
* norm_ratio's kernel bit for bit equal to its Python twin, on the CPU and on CUDA;
* one gradient of more than 2^31 elements: counts, abs-max, found_inf and every unscaled value
  exact against a chunked plain-torch computation (no 32-bit index anywhere).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import strategies
from strategies import kernels, stats
from strategies.rules.norm_ratio import norm_ratio_update_
from strategies.formats import FP16_MIN_NORMAL
from strategies.stats import unscale_and_stats
from tests.cuda.gradients import assert_bits_equal, make_grads
from tests.cuda.samples import SAMPLES
from tests.cuda.gpu import CHUNK, check_stats, no_sync, to_cuda
from tests.cuda.trajectories import NORM_RATIO_CASES, STEPS, assert_states_equal, random_absmax
from tests.helpers import batch, fp16_safe, mlp, strategy_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- (a) the single-scale path
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_groups", [1, 3])
@pytest.mark.parametrize("inv_value", [2.0**-10 * 1.375, 1.0], ids=["unscale", "read_only"])
@pytest.mark.parametrize("specials", [("zero", "fp16_min_sub", "below_min_normal"), ("nan", "inf", "zero")],
                         ids=["finite", "non_finite"])
def test_single_scale_stats_match_reference(cuda_ops, dtype, num_groups, inv_value, specials):
    """One inverse scale (shape ``[]``) for every group — the kernel's ``inv_per_group = 0`` path
    that every global rule takes — against the plain-torch reference on the same GPU."""
    sizes = [0, 1, 7, 1000, 65_537, 300_001, 6, CHUNK + 5]
    layouts = ("contiguous", "strided", "offset", "transposed")
    groups = None if num_groups == 1 else [k % num_groups for k in range(len(sizes))]
    inv = torch.tensor(inv_value, device="cuda")
    a = to_cuda(make_grads(sizes, dtype, seed=21, specials=specials, layouts=layouts))
    b = to_cuda(make_grads(sizes, dtype, seed=21, specials=specials, layouts=layouts))
    got = check_stats(cuda_ops, a, b, inv, groups, num_groups)
    assert got.numel.sum().item() == sum(g.numel() for g in b)


# ---------------------------------------------------------------- (b) every strategy reaches its op
TRAIN_STEPS = 6
OVERFLOW_AT = 3
CASES = {p.id: p.values for p in strategy_cases() if p.values[1].get("enabled", True)}
"""case id -> (rule name, keywords): every registered rule and every enabled preset."""


def train_on_cuda(name: str, kw: dict) -> dict[str, torch.Tensor]:
    """``TRAIN_STEPS`` fp16-autocast SGD steps of a small MLP on CUDA under strategy ``name``
    (attached, with the fp32 reference closure, probing every 2nd step where the rule probes), an
    Inf planted in a gradient at step ``OVERFLOW_AT``. Returns every state tensor (the probe's host
    timings left out), the parameters and the update count, on the CPU."""
    model = mlp(seed=0).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probing = {f.name for f in fields(strategies.get(name).Params)} & {"probe_interval"}
    s = strategies.create(name, "cuda", **{**fp16_safe(kw), **{k: 2 for k in probing}})
    s.attach(model)
    cur: dict[str, torch.Tensor] = {}
    s.set_reference(lambda: F.mse_loss(model(cur["x"]), cur["y"]))
    for step in range(TRAIN_STEPS):
        cur["x"], cur["y"] = (t.cuda() for t in batch(step))
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.mse_loss(model(cur["x"]).float(), cur["y"])
        s.scale(loss).backward()
        if step == OVERFLOW_AT:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        s.step(opt)
        s.update()
    out = {f"state.{n}": getattr(s.state, n).cpu() for n in s.state.specs if not n.endswith("_time_s")}
    out.update({f"param.{k}": p.detach().cpu() for k, p in model.named_parameters()})
    out["updates"] = torch.tensor(s.updates)
    return out


def plain_torch_runs() -> dict[str, dict[str, torch.Tensor]]:
    """:func:`train_on_cuda` for every case, in a process started with ``SCALELAB_KERNELS=0``."""
    assert not kernels.available(), "SCALELAB_KERNELS=0 should leave the extension unloaded"
    return {case: train_on_cuda(*values) for case, values in CASES.items()}


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("plain") / "runs.pt"
    code = ("import sys, torch; from tests.cuda.test_gpu_cases import plain_torch_runs; "
            "torch.save(plain_torch_runs(), sys.argv[1])")
    env = {**os.environ, "SCALELAB_KERNELS": "0"}
    done = subprocess.run([sys.executable, "-c", code, str(path)], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(path, weights_only=True)


def refuse(what: str) -> Callable[..., Any]:
    def raiser(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{what} ran on CUDA: the kernel path was not taken")

    return raiser


@pytest.fixture
def kernels_only(cuda_ops, monkeypatch) -> set[str]:
    """Every Python twin behind :func:`kernels.dispatch` and the plain-torch statistics and
    fraction fallbacks raise; returns the set of ops reached (filled as the test runs)."""
    reached: set[str] = set()
    dispatch, fused = kernels.dispatch, kernels.unscale_and_stats

    def strict_dispatch(op: str, twin: Callable[..., None], *args: Any) -> None:
        reached.add(op)
        dispatch(op, refuse(f"the Python twin of {op}"), *args)

    def counted_stats(*args: Any) -> Any:
        out = fused(*args)
        if out is not None:
            reached.add("unscale_and_stats")
        return out

    monkeypatch.setattr(kernels, "dispatch", strict_dispatch)
    monkeypatch.setattr(kernels, "unscale_and_stats", counted_stats)
    monkeypatch.setattr(stats, "unscale_and_stats_reference", refuse("unscale_and_stats_reference"))
    monkeypatch.setattr(stats, "count_fraction_reference", refuse("count_fraction_reference"))
    return reached


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit-identical floats (NaN where NaN, any payload: plain torch's CUDA kernels write CUDA's
    canonical NaN), equal integers."""
    try:
        if got.is_floating_point():
            assert_bits_equal(got.reshape(-1), want.reshape(-1))  # 1-d: its message indexes the first difference
        else:
            assert got.dtype == want.dtype and torch.equal(got, want)
    except AssertionError as exc:
        raise AssertionError(f"{what}: {got.tolist()} != {want.tolist()}") from exc


def rule_ops(name: str, kw: dict) -> set[str]:
    """The op a rule's update must reach: ``<rule>_update_`` where the library has one, AdaLoss's
    step for layerwise's ``adaloss`` rule; none for ``native`` with ``hysteresis`` 1, which is
    torch's own ``torch._amp_update_scale_`` (as GradScaler), nor for ``static`` (no update)."""
    if name == "native" and kw.get("hysteresis", 1) == 1:
        return set()
    if kw.get("rule") == "adaloss":
        return {"adaloss_step_"}
    return {f"{name}_update_"} & set(kernels.op_names())


@pytest.mark.parametrize("case", list(CASES))
def test_every_strategy_reaches_its_op_on_cuda(kernels_only, plain_runs, case):
    name, kw = CASES[case]
    got = train_on_cuda(name, kw)
    assert {"unscale_and_stats", "record_step_", *rule_ops(name, kw)} <= kernels_only, sorted(kernels_only)
    want = plain_runs[case]
    assert got.keys() == want.keys()
    for key in got:
        assert_same(got[key], want[key], f"{key} (kernels vs SCALELAB_KERNELS=0)")
    assert got["state.skipped_steps"].item() >= 1, "the planted overflow was not skipped"


# ---------------------------------------------------------------- (c) streams and graph capture
OP_CASES = [(op, k) for op in sorted(SAMPLES) for k in range(len(SAMPLES[op]))]
SLEEP_CYCLES = 50_000_000  # about 30 ms at 1.7 GHz: far longer than launching the op


def to_device(args: tuple) -> tuple:
    """An argument list on CUDA: gradient lists with their layouts (``to_cuda``), tensors, scalars as is."""
    return tuple(to_cuda(a) if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)
                 else a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


def tensors_of(args: tuple, out: Any = None) -> list[torch.Tensor]:
    """Every tensor an op call reads, writes or returns, in a fixed order."""
    flat = [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]
    outs = [] if out is None else list(out) if isinstance(out, (tuple, list)) else [out]
    return flat + outs


def snapshot(args: tuple, out: Any = None) -> list[torch.Tensor]:
    return [t.detach().cpu().clone() for t in tensors_of(args, out)]


def assert_snapshots_equal(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, f"{what}, tensor {k} (vs the eager call)")


def call(op_name: str, args: tuple) -> Any:
    return getattr(torch.ops.scalelab, op_name)(*args)


def garbage_(args: tuple) -> None:
    """Overwrite every input tensor with a value no case holds (the op must not see it)."""
    for t in tensors_of(args):
        t.fill_(-7.0 if t.is_floating_point() else 77)


def inputs_after_sleep(make: Callable[[], tuple]) -> tuple[tuple, torch.cuda.Stream]:
    """An argument list on CUDA holding garbage, and a new side stream on which a ~30 ms
    ``_sleep`` and then the copies of the real values into it are queued (not yet run)."""
    src, dst = to_device(make()), to_device(make())
    garbage_(dst)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        for d, s in zip(tensors_of(dst), tensors_of(src)):
            d.copy_(s)
    return dst, side


@pytest.mark.parametrize("op_name,case", OP_CASES)
def test_op_runs_on_the_current_stream(cuda_ops, op_name, case):
    """The op called on the side stream whose queued work writes its inputs: it sees them only if
    it is enqueued on the current stream (not the default one)."""
    make = SAMPLES[op_name][case]
    eager = to_device(make())
    want = snapshot(eager, call(op_name, eager))
    dst, side = inputs_after_sleep(make)
    with torch.cuda.stream(side):
        out = call(op_name, dst)
    torch.cuda.current_stream().wait_stream(side)
    assert_snapshots_equal(snapshot(dst, out), want, f"{op_name} on a side stream")


def test_stream_check_would_catch_a_wrong_stream(cuda_ops):
    """Control of the test above: the same op enqueued on another stream that does not wait
    reads the garbage, so the sleep is long enough to tell the two apart."""
    make = SAMPLES["native_update_"][1]
    eager = to_device(make())
    want = snapshot(eager, call("native_update_", eager))
    dst, _ = inputs_after_sleep(make)
    call("native_update_", dst)  # current (default) stream: not ordered after the side stream
    torch.cuda.synchronize()
    with pytest.raises(AssertionError):
        assert_snapshots_equal(snapshot(dst), want, "control")


@pytest.mark.parametrize("op_name,case", OP_CASES)
def test_op_in_cuda_graph_equals_eager(cuda_ops, op_name, case):
    """Captured once, replayed twice: the state and outputs of two eager calls (the graph reads
    the current inputs at every replay and does not sync, which capture would refuse)."""
    make = SAMPLES[op_name][case]
    eager = to_device(make())
    want = [snapshot(eager, call(op_name, eager)) for _ in range(2)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs recommends
        call(op_name, to_device(make()))
    torch.cuda.current_stream().wait_stream(side)
    static = to_device(make())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(op_name, static)
    for d, s in zip(tensors_of(static), tensors_of(to_device(make()))):  # inputs as before capture
        d.copy_(s)
    for k in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert_snapshots_equal(snapshot(static, out), want[k], f"{op_name} replay {k + 1}")


# ---------------------------------------------------------------- (d) norm_ratio bit for bit
def norm_ratio_steps(case: tuple, seed: int) -> list[tuple]:
    """Per-step arguments of norm_ratio_update_: random sums of squares (ratios around 1, some
    0/Inf/NaN), overflows and probe flags, then the case's hyper-parameters."""
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(STEPS):
        ref_ss, mp_ss = random_absmax(gen, 2).square()
        mp_ss = mp_ss * torch.exp2(torch.randint(-12, 13, (), generator=gen).float())
        found = torch.tensor(float(torch.rand((), generator=gen) < 0.1))
        probed = bool(torch.rand((), generator=gen) < 0.5)
        steps.append((found, ref_ss.reshape(()), mp_ss.reshape(()), probed, *case))
    return steps


def norm_ratio_state(device: str) -> tuple[torch.Tensor, ...]:
    i32 = dict(dtype=torch.int32, device=device)
    return (torch.tensor(2.0**16, device=device), torch.tensor(0, **i32), torch.tensor(0.0, device=device),
            torch.tensor(0, **i32), torch.tensor(float("nan"), device=device))


@pytest.mark.parametrize("case", NORM_RATIO_CASES, ids=lambda c: "-".join(map(str, c)))
def test_norm_ratio_kernel_equals_twin_bit_for_bit(cuda_ops, case):
    """Every state tensor — the log-ratio EMA and the raw ratio included — bit for bit after every
    step, NaN bits too: the kernel on CUDA against the Python twin on the CPU. The twin run on CUDA
    agrees as well, up to NaN payloads (torch's CUDA kernels write CUDA's canonical NaN, its CPU
    kernels the host's, e.g. for the raw ratio 0 / 0)."""
    kernel, twin_cpu, twin_cuda = norm_ratio_state("cuda"), norm_ratio_state("cpu"), norm_ratio_state("cuda")
    probes = 0
    for i, args in enumerate(norm_ratio_steps(case, seed=case[2])):
        dev_args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
        with no_sync():
            cuda_ops.norm_ratio_update_(*kernel, *dev_args)
        norm_ratio_update_(*twin_cpu, *args)
        norm_ratio_update_(*twin_cuda, *dev_args)
        assert_states_equal(i, tuple(t.cpu() for t in kernel), twin_cpu)
        for k, (t, c) in enumerate(zip(twin_cuda, twin_cpu)):
            assert_same(t.cpu(), c, f"step {i}, state {k}: twin on CUDA vs on the CPU")
        probes = twin_cpu[3].item()
    assert probes > 0, "no valid probe fed the EMA: the test would not test the ratio"


# ---------------------------------------------------------------- (e) more than 2^31 elements
BIG = 2**31 + 7
SPLIT = 2**28


def chunked_counts(g: torch.Tensor) -> tuple[int, int]:
    """(zeros, subnormals: 0 < |x| < 2^-14) of ``g``, counted over slices of 2^28 elements."""
    zeros = tiny = 0
    for part in g.split(SPLIT):
        zeros += int((part == 0).sum())
        tiny += int((part.abs() < FP16_MIN_NORMAL).sum())
    return zeros, tiny - zeros


def big_gradient() -> torch.Tensor:
    """2^31 + 7 float16 values ~ N(0, 1e-3) (about 5% subnormal), every 997th zero, and the
    largest magnitude at index 2^31 + 5, beyond any 32-bit index."""
    g = torch.empty(BIG, dtype=torch.float16, device="cuda")
    torch.manual_seed(24)
    for part in g.split(SPLIT):
        part.normal_(0.0, 1e-3)
    g[::997] = 0.0
    g[2**31 + 1] = 0.0
    g[2**31 + 3] = 2.0**-20  # subnormal in the tail
    g[2**31 + 5] = -3.0
    return g


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.mem_get_info()[0] < 14 * 2**30,
                    reason="needs 14 GiB of free GPU memory")
def test_gradient_above_2_pow_31_elements(cuda_ops):
    g = big_gradient()
    orig = g.clone()
    zeros, subnormals = chunked_counts(g)
    inv = torch.tensor(2.0**-3, device="cuda")
    st = unscale_and_stats([g], inv)
    assert st.numel.item() == BIG
    assert (st.zeros.item(), st.subnormals.item()) == (zeros, subnormals)
    assert st.found_inf.item() == 0.0
    assert st.absmax.item() == 3.0 * 2.0**-3
    for got, before in zip(g.split(SPLIT), orig.split(SPLIT)):
        assert_bits_equal(got, (before.float() * 2.0**-3).half())
    del orig
    g[-1] = float("inf")  # read-only pass (inv 1): the flag from the last element
    st = unscale_and_stats([g], torch.tensor(1.0, device="cuda"))
    assert st.found_inf.item() == 1.0 and st.numel.item() == BIG
