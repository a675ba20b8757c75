"""The one binding module between ``strategies`` and the ``cuda/`` extension (``torch.ops.scalelab``).

On first use :func:`load` builds the extension (:mod:`strategies.kernel_build`: sources, build
folder, flags and architectures) and loads it. Loading also registers the fake (meta)
implementation of every op (``torch.library.register_fake``). When no compiler is available or
the build fails, :func:`unscale_and_stats` returns ``None`` (the caller runs the plain-torch
reference) and :func:`dispatch` runs the rule's Python twin; a one-time ``RuntimeWarning`` says why.

Two entry points: :func:`unscale_and_stats` (the statistics pass) and :func:`dispatch` (every
rule's update op, ``torch.ops.scalelab.<rule>_update_``, or its Python twin with the same
arguments).

Environment: ``SCALELAB_KERNELS=0`` — never build or load; always the plain-torch path (the build's
own variables: :mod:`strategies.kernel_build`). If the CUDA part fails to build, the CPU ops are
built alone (with a warning).

At the first CUDA use of a device the ops check it: a GPU before Volta turns every CUDA op off
there, and a driver older than CUDA 12.1 (which first accepts 32 KB kernel parameters) turns
the statistics kernel off, each with one ``RuntimeWarning``; the plain-torch path (the twins)
runs instead of failing at the first step.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from typing import Any, Callable, Sequence

import torch

from strategies import kernel_build
from strategies.kernel_build import MIN_CAPABILITY

__all__ = [
    "available",
    "boundary_applies",
    "check_update_args",
    "dispatch",
    "f32_of_double",
    "load",
    "op_names",
    "unavailable_reason",
    "unscale_and_stats",
    "update_applies",
]

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_reason: str = ""


def load() -> bool:
    """Build (first time) and load the extension; ``True`` when ``torch.ops.scalelab`` is usable."""
    global _loaded, _reason
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        if os.environ.get("SCALELAB_KERNELS", "1") == "0":
            _loaded, _reason = False, "disabled by SCALELAB_KERNELS=0"
            return False
        try:
            with_cuda = kernel_build.use_cuda()
            old = [i for i in range(torch.cuda.device_count()) if _capability(i) < MIN_CAPABILITY] \
                if with_cuda else []
            if with_cuda and len(old) == torch.cuda.device_count():
                warnings.warn(f"scalelab: no CUDA kernels: {_device_reason(old[0])}; building the CPU ops only",
                              RuntimeWarning, stacklevel=3)
                with_cuda = False
            try:
                kernel_build.build(with_cuda)
            except Exception as exc:
                if not with_cuda:
                    raise
                # The CUDA part failed (nvcc / host compiler mismatch, no buildable arch, ...): keep the CPU twin.
                warnings.warn(f"scalelab: CUDA kernels failed to build ({type(exc).__name__}: {_last_line(exc)}); "
                              "building the CPU ops only", RuntimeWarning, stacklevel=3)
                kernel_build.build(False)
            _loaded = hasattr(torch.ops.scalelab, "unscale_and_stats")
            if _loaded:
                _register_fakes()
            else:
                _reason = "the built library registered no scalelab ops"
        except Exception as exc:  # no compiler, failed build, missing sources: fall back
            _loaded = False
            _reason = f"{type(exc).__name__}: {_last_line(exc)}"
        if not _loaded:
            warnings.warn(
                f"scalelab: fused kernels unavailable ({_reason}); using the plain-torch path",
                RuntimeWarning,
                stacklevel=3,
            )
        return _loaded


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1] if text else ""


def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def _device_reason(index: int) -> str:
    major, minor = _capability(index)
    return (f"cuda:{index} ({torch.cuda.get_device_name(index)}) is sm_{major}{minor}, the kernels need "
            f"Volta (sm_70) or newer")


_CUDA_OFF: dict[tuple[str, int], bool] = {}
"""(what, device index) -> whether that part of the CUDA ops is off there: what = "all" (a GPU
before Volta) or "stats" (a driver before CUDA 12.1, seen at the statistics kernel's first launch)."""


def _cuda_on(index: int | None, what: str = "all") -> bool:
    """Whether the CUDA ops may run on device ``index`` (checked once per device, one warning)."""
    i = torch.cuda.current_device() if index is None else index
    off = _CUDA_OFF.get(("all", i))
    if off is None:
        off = _capability(i) < MIN_CAPABILITY
        _CUDA_OFF[("all", i)] = off
        if off:
            warnings.warn(f"scalelab: CUDA kernels off: {_device_reason(i)}; using the plain-torch path",
                          RuntimeWarning, stacklevel=4)
    return not (off or _CUDA_OFF.get((what, i), False))


def _stats_off(index: int | None, message: str) -> None:
    i = torch.cuda.current_device() if index is None else index
    if not _CUDA_OFF.get(("stats", i)):
        _CUDA_OFF[("stats", i)] = True
        warnings.warn(f"{message}; using the plain-torch statistics pass there", RuntimeWarning, stacklevel=4)


def op_names() -> list[str]:
    """Names of the ops the loaded library defines (``torch.ops.scalelab.<name>``), sorted."""
    return sorted({n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                   if n.startswith("scalelab::")})


def _register_fakes() -> None:
    """Fake (meta) implementations of every op, for FakeTensor tracing and ``torch.compile``:
    shapes and dtypes of the outputs, nothing computed. Every op that returns nothing (the rules'
    update ops rewrite their state tensors in place, as their schemas declare) gets the same
    no-op fake, so a new rule's op needs nothing here."""

    def unscale_and_stats_fake(
        grads: list[torch.Tensor], inv_scale: torch.Tensor, group_index: list[int], num_groups: int
    ) -> tuple[torch.Tensor, ...]:
        f = [inv_scale.new_empty((num_groups,), dtype=torch.float32) for _ in range(3)]
        i = [inv_scale.new_empty((num_groups,), dtype=torch.int64) for _ in range(3)]
        return (*f, *i)

    def update_fake(name: str) -> Callable[..., None]:
        op = getattr(torch.ops.scalelab, name).default

        def fake(*args: Any) -> None:
            # Runs for meta tensors too: a real tensor among them means mixed devices, which the
            # real op refuses with this message (dispatch then runs the Python twin).
            ts = [a for a in args if isinstance(a, torch.Tensor)]
            if any(t.device.type == "meta" for t in ts) and any(
                    type(t) is torch.Tensor and t.device.type != "meta" for t in ts):
                other = next(t for t in ts[1:] if t.device != ts[0].device)
                raise RuntimeError(f"scalelab: tensor is on {other.device} but the scale is on {ts[0].device}")
            check_update_args(op, args)

        return fake

    def count_fraction_fake(numel: torch.Tensor, counts: torch.Tensor,
                            more: torch.Tensor | None = None) -> torch.Tensor:
        return numel.new_empty((), dtype=torch.float32)

    def boundary_rescale_fake(grad: torch.Tensor, ratios: torch.Tensor, index: int) -> tuple[torch.Tensor, ...]:
        return torch.empty_like(grad, memory_format=torch.contiguous_format), grad.new_empty((2,), dtype=torch.float64)

    fakes = {"boundary_rescale": boundary_rescale_fake,
             "grad_extremes": lambda grad: grad.new_empty((2,), dtype=torch.float64),
             "exponent_histogram": lambda grad: grad.new_empty((280,), dtype=torch.int64)}
    for name in op_names():
        if name in fakes:
            torch.library.register_fake(f"scalelab::{name}", fakes[name])
        elif name == "unscale_and_stats":
            torch.library.register_fake("scalelab::unscale_and_stats", unscale_and_stats_fake)
        elif name == "count_fraction":
            torch.library.register_fake("scalelab::count_fraction", count_fraction_fake)
        elif not getattr(torch.ops.scalelab, name).default._schema.returns:
            torch.library.register_fake(f"scalelab::{name}", update_fake(name))
        else:
            raise RuntimeError(f"scalelab::{name} returns values: give it a fake implementation in kernels.py")


def check_update_args(op: Any, args: Sequence[Any]) -> None:
    """Check the shapes, dtypes and contiguity of an update op's tensor arguments (fake, meta or
    real, any device) exactly as the op itself does, without touching their values: the op's CPU
    implementation runs on zero-filled CPU scratch tensors of the same metadata, and its checks
    (``cuda/cpu/update_cpu.cpp``: each state tensor ``[G]`` or ``[]`` of its dtype, ``found_inf``
    ``[G]`` or ``[1]``, ...) raise their own ``scalelab: <argument> must ...`` message. So a
    traced or compiled call (``torch.compile``, FakeTensor mode) refuses what the real op would,
    and the expectations are written once, in the op. The scratch update is thrown away."""
    with torch.utils._python_dispatch._disable_current_modes():
        op(*[_scratch(a) if isinstance(a, torch.Tensor) else a for a in args])


def _scratch(t: torch.Tensor) -> torch.Tensor:
    """Zeros on the CPU with ``t``'s shape and dtype, contiguous where ``t`` is."""
    shape = [int(d) for d in t.shape]
    return torch.zeros(shape, dtype=t.dtype) if t.is_contiguous() else torch.zeros([*shape, 2], dtype=t.dtype)[..., 0]


def available() -> bool:
    """Whether the compiled ops can be used (builds/loads on first call)."""
    return load()


def unavailable_reason() -> str:
    """Why :func:`load` fell back (empty while loaded or not yet tried)."""
    return _reason


def unscale_and_stats(
    grads: Sequence[torch.Tensor],
    inv_scale: torch.Tensor,
    group_index: Sequence[int] | None,
    num_groups: int,
) -> tuple[torch.Tensor, ...] | None:
    """``torch.ops.scalelab.unscale_and_stats`` when it applies, else ``None`` (use the reference).

    Returns ``(found_inf, absmax, sumsq, zeros, subnormals, numel)``, each of shape ``[num_groups]``
    on ``inv_scale``'s device. It applies when the extension is loaded, every gradient is
    float32/float16/bfloat16 on ``inv_scale``'s device, and that device has an implementation
    (CPU always; CUDA when built with CUDA).
    """
    if not (_loaded or load()):
        return None
    dev = inv_scale.device
    if dev.type not in ("cpu", "cuda") or inv_scale.dtype != torch.float32:
        return None
    if dev.type == "cuda" and not (torch._C._dispatch_has_kernel_for_dispatch_key(
            "scalelab::unscale_and_stats", "CUDA") and _cuda_on(dev.index, "stats")):
        return None
    if group_index is None:
        gi: list[int] = []
    else:
        gi = [int(i) for i in group_index]
        if len(gi) != len(grads):
            raise ValueError(f"group_index must have one entry per gradient ({len(grads)}), got {len(gi)}")
        if not all(0 <= i < num_groups for i in gi):
            bad = next(i for i in gi if not 0 <= i < num_groups)
            raise ValueError(f"group_index entries must be in [0, {num_groups}), got {bad}")
    if inv_scale.numel() not in (1, num_groups):
        raise ValueError(f"inv_scale must have 1 or {num_groups} elements, got {inv_scale.numel()}")
    # Device and dtype of every gradient are checked by the op itself, before it touches any
    # value (a Python loop over the tensors would cost more than the pass on small models); a
    # gradient it does not take sends the caller to the plain-torch path.
    try:
        with torch.no_grad():
            return tuple(torch.ops.scalelab.unscale_and_stats.default(
                grads if isinstance(grads, list) else list(grads), inv_scale, gi, int(num_groups)))
    except RuntimeError as exc:
        if _OLD_DRIVER in str(exc):
            _stats_off(dev.index, _last_line(exc))
            return None
        if any(m in str(exc) for m in _DECLINED):
            return None
        raise


_DECLINED = ("must be float32, float16 or bfloat16", "every gradient must be on")
_OLD_DRIVER = "scalelab: the statistics kernel needs a CUDA 12.1+ driver"
"""The shim's message (cuda/cuda_shim.cpp) when the driver cannot take a 32 KB kernel parameter."""


_OP_ON: dict[tuple[str, str], bool] = {}
"""(op, device type) -> whether ``torch.ops.scalelab.<op>`` has an implementation there (cached:
a rule asks every step)."""


def _op_on(op: str, device_type: str) -> bool:
    key = (op, device_type)
    known = _OP_ON.get(key)
    if known is None:
        known = bool((_loaded or load()) and hasattr(torch.ops.scalelab, op)) and (
            device_type == "cpu"
            or (device_type == "cuda" and torch._C._dispatch_has_kernel_for_dispatch_key(f"scalelab::{op}", "CUDA")))
        if _loaded is not None:  # decided: the extension was tried
            _OP_ON[key] = known
    return known


def update_applies(op: str, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``torch.ops.scalelab.<op>`` can run on these state/statistics tensors: one device
    with an implementation, contiguous float32/int32/int64 (a loop over them: for callers that
    hold a few tensors; :func:`dispatch` lets the op check instead)."""
    dev = tensors[0].device
    if not _op_on(op, dev.type):
        return False
    return all(t.device == dev and t.is_contiguous() and t.dtype in _RULE_DTYPES for t in tensors)


_RULE_DTYPES = (torch.float32, torch.int32, torch.int64)
_BOUNDARY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def boundary_applies(op: str, grad: torch.Tensor) -> bool:
    """Whether the layer-boundary read ``torch.ops.scalelab.<op>`` (``boundary_rescale``,
    ``grad_extremes``, ``exponent_histogram``: ``cuda/cpu/boundary_cpu.cpp``) runs for ``grad``: a
    plain float32/float16/bfloat16 tensor that does not require grad (a create_graph backward
    differentiates the torch reference; FakeTensors and other subclasses take it too) on a device
    with the op. Host metadata only."""
    if type(grad) is not torch.Tensor or grad.dtype not in _BOUNDARY_DTYPES or grad.requires_grad:
        return False
    return _runnable(op, grad.device) is not None
_FOREIGN = re.compile(
    r"^scalelab: \w+ (is on \S+ but the scale is on|must be contiguous|must be (Float|Int|Long), got)")
"""The op's own messages (cuda/cpu/update_cpu.cpp ``check``) for a tensor it does not take, checked
before it writes anything: dispatch then runs the Python twin instead."""


def f32_of_double(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` (a transcendental: sqrt, log2, exp2) of float32 ``x`` evaluated in double and rounded
    once to float32, as the rule headers' ``log2_f``/``exp2_f`` compute it on every device
    (``cuda/include/scalelab_common.h``): the Python twins use it so that they and the ops agree
    bit for bit, torch's float32 kernels (vectorised, MKL) not being correctly rounded."""
    return fn(x.double()).float()


def dispatch(op: str, twin: Callable[..., Any], *args: Any) -> None:
    """Run a rule's update: ``torch.ops.scalelab.<op>(*args)`` when the extension is built and the
    op applies to these tensors (one device with an implementation, contiguous float32/int32/int64),
    else its Python twin ``twin(*args)``.

    The op's schema and the twin's signature are the same positional list (the twin is the oracle
    of the op in ``tests/cuda``), so a rule calls ``dispatch("<rule>_update_", <rule>_update_, ...)``
    and nothing else; adding a kernel for a rule touches the rule header, the CPU twin, the ``.cu``
    and the op registration only (recipe: ``cuda/README.md``).
    """
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None  # every op starts with the scale
    fn = None if first is None else _runnable(op, first.device)
    if fn is not None:
        # The op checks device, dtype and contiguity of every tensor before it writes anything (a
        # Python loop over them here cost more than the op); one it does not take is declined.
        try:
            fn(*args)
            return
        except RuntimeError as exc:
            if not _FOREIGN.match(str(exc)):
                raise
    twin(*args)


_RUNNABLE: dict[tuple[str, torch.device], Any] = {}
"""(op, device) -> the op's overload to call there, or None (the twin runs): decided once the
extension was tried, since a rule dispatches twice every step and a per-layer rule asks at every
boundary (dispatch: 2.5 -> 1.7 us per call on this CPU)."""


def _runnable(op: str, device: torch.device) -> Any:
    """The op's overload when it has an implementation on ``device`` and the CUDA ops may run
    there (:func:`_op_on`, :func:`_cuda_on`), else None."""
    key = (op, device)
    if key in _RUNNABLE:
        return _RUNNABLE[key]
    on = _op_on(op, device.type) and (device.type != "cuda" or _cuda_on(device.index))
    fn = getattr(torch.ops.scalelab, op).default if on else None
    if _loaded is not None and (device.type != "cuda" or device.index is not None):
        _RUNNABLE[key] = fn
    return fn
