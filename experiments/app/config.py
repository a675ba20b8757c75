"""The run options the loop reads, typed: :class:`RunConfig` (``seed``, ``device``, ``threads``,
``sweep``, ``tags``), its :class:`TrainConfig` (``train.*``), :class:`RegimeConfig` (``regime.*``)
and :class:`DistributedConfig` (``distributed.*``).

Each option is declared once, as a strategy's ``Params`` field is (:func:`strategies.params.hp`):
its type, default, allowed range (a check from :mod:`strategies.validation`), source and meaning.
These dataclasses are the one home of the options' defaults and meanings: the config tree merges
its files onto their node (``scalelab_schema/run``, :mod:`experiments.app.config_store`), so
``conf/config.yaml``, ``conf/regime/*.yaml`` and the experiments state only what differs, and every
option is overridable without ``+`` (``scalelab-train --cfg job`` prints them all). Building one
validates and normalises every field, raising one line that names the option, e.g. ``train.steps
must be an integer >= 1, got 0``.

:meth:`RunConfig.from_hydra` checks the whole composed config first (:func:`composed`), then builds
the run options from it; every error is a one-line :class:`~experiments.app.build.ConfigError`, and
the loop never looks a key up again. The groups the builders consume (``model``, ``data``,
``optimizer``, ``strategy``, ``precision``, ``logger``) stay in the Hydra config, which is also what
the run record stores.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, ClassVar, Optional, TypeVar

import torch
from omegaconf import DictConfig, OmegaConf

from experiments import schema
from experiments.app import recipe
from experiments.app.build import ConfigError, check_targets, one_line
from strategies import validation as v
from strategies.params import hp

__all__ = ["RunConfig", "TrainConfig", "RegimeConfig", "DistributedConfig", "Options", "composed", "GROUPS"]

GROUPS = ("model", "data", "precision", "strategy", "regime", "logger", "train", "optimizer")
"""The mappings every composed config has."""
_BUILT = ("model", "data", "strategy", "optimizer")
"""The groups built from their ``_target_``."""
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
O = TypeVar("O", bound="Options")


def _text(field: str, value: Any) -> str:
    """Any scalar, as its text (``sweep=3`` is the sweep named ``"3"``)."""
    if isinstance(value, (dict, list)):
        v.fail(field, "a name", value)
    return str(value)


def _label(field: str, value: Any) -> str:
    """A name the config file must give (``???``, OmegaConf's missing value, is refused)."""
    if not isinstance(value, str) or not value or value == "???":
        v.fail(field, "set to a name (each conf/regime/*.yaml states its own)", value)
    return value


def _strings(field: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) for x in value):
        v.fail(field, "a list of strings", value)
    return tuple(value)


def _steps(field: str, value: Any) -> frozenset[int]:
    if not isinstance(value, (list, tuple, frozenset)) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in value):
        v.fail(field, "a list of steps >= 1", value)
    return frozenset(value)


@dataclass(frozen=True)
class Options:
    """Base of the option dataclasses: building one checks and normalises every field with its
    ``hp`` check, naming it ``<prefix><field>`` (``train.steps``)."""

    prefix: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            if check is not None:
                object.__setattr__(self, f.name, check(self.prefix + f.name, getattr(self, f.name)))

    @classmethod
    def from_node(cls: type[O], node: Mapping[str, Any]) -> O:
        """Built from a config mapping; a key that is not an option is refused (a typo)."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [key for key in node if key not in names]
        if unknown:
            raise ValueError(f"{cls.prefix}{unknown[0]} is not an option; {cls.prefix}* are: {', '.join(names)}")
        return cls(**node)


@dataclass(frozen=True)
class TrainConfig(Options):
    """``train.*``: the length, batch, learning-rate schedule, cadence and stops of a run."""

    prefix: ClassVar[str] = "train."

    steps: int = hp(150, v.whole(1), "scalelab", "optimizer steps")
    batch_size: int = hp(32, v.whole(1), "scalelab", "global batch; split across ranks under DDP")
    grad_clip: float = hp(1.0, v.number(0.0, math.inf), "nanoGPT (grad_clip 1.0)",
                          "max L2 norm of the unscaled gradients; 0 = off")
    lr_warmup: int = hp(10, v.whole(0), "nanoGPT get_lr", "linear warmup steps of the learning rate")
    lr_decay: str = hp("cosine", v.named(*recipe.DECAYS), "nanoGPT get_lr",
                       "cosine (to min_lr_ratio * lr at the last step) | constant")
    min_lr_ratio: float = hp(0.1, v.number(0.0, 1.0), "nanoGPT (min_lr = lr / 10)",
                             "the cosine's floor as a fraction of the optimizer's lr")
    log_every: int = hp(10, v.whole(1), "scalelab", "train lines + telemetry read from the device every N steps")
    hist_every: int = hp(50, v.whole(0), "scalelab", "activation-gradient exponent histogram on the first "
                         "log step past each multiple; 0 = off")
    eval_every: int = hp(50, v.whole(0), "scalelab", "evaluation every N steps; 0 = only at the end")
    eval_batches: int = hp(8, v.whole(1), "scalelab", "batches per evaluation")
    checkpoint_every: int = hp(50, v.whole(0), "scalelab", "checkpoint every N steps; 0 = never (no resume)")
    resume: bool = hp(True, v.flag, "scalelab", "resume <run dir> when it holds this run (same config); false: "
                      "start over there, earlier records moved to replaced-<n>/")
    warmup: int = hp(5, v.whole(0), "scalelab", "steps left out of the mean step time")
    divergence_loss: float = hp(100.0, v.number(0.0, math.inf, "(]"), "scalelab",
                                "a logged training loss above this (or non-finite) stops the run: diverged")
    fidelity_every: int = hp(0, v.whole(0), "scalelab", "every N steps compare the step's unscaled gradient with "
                             "the fp32 gradient (cosine, relative error, lost entries); 0 = off")
    trace: bool = hp(True, v.flag, "scalelab", "write trace.jsonl: every step's statistics, flushed at the "
                     "logging interval (docs/run-records.md; scalelab-replay reads it)")
    trace_act: bool = hp(True, v.flag, "scalelab", "with trace, also record each step's forward activation abs-max "
                         "(forward hooks on the model's leaf modules; the early warning's headroom)")
    zero_grad: bool = hp(True, v.flag, "scalelab", "false: optimizer.zero_grad() does nothing (a loop bug on "
                         "purpose, experiments.app.build.keep_gradients; docs/doctor.md)")
    max_consecutive_skips: int = hp(100, v.whole(0), "scalelab", "this many skipped steps in a row (the scale "
                                    "collapsed) stop the run: stalled; 0 = off")
    deterministic: bool = hp(False, v.flag, "torch.use_deterministic_algorithms", "deterministic kernels")
    progress: bool = hp(True, v.flag, "tqdm", "progress bar (only shown on a terminal)")
    kill_at_step: Optional[int] = hp(None, v.optional(v.whole(1)), "scalelab",
                                     "testing aid: SIGKILL this process right after this step")

    def lr_schedule(self, lr: float) -> Callable[[int], float]:
        """``step -> lr`` for the optimizer's base rate ``lr`` (:func:`experiments.app.recipe.lr_at`)."""
        return partial(recipe.lr_at, steps=self.steps, lr=float(lr), warmup=self.lr_warmup, decay=self.lr_decay,
                       min_lr_ratio=self.min_lr_ratio)

    def log_step(self, step: int) -> bool:
        """A train line (and a telemetry read) every ``log_every`` steps and at the last step."""
        return step % self.log_every == 0 or step == self.steps

    def histogram_step(self, step: int) -> bool:
        """The exponent histogram goes on the first logging step at or after each multiple of
        ``hist_every``."""
        prev_log = ((step - 1) // self.log_every) * self.log_every
        return self.log_step(step) and self.hist_every > 0 and step // self.hist_every > prev_log // self.hist_every

    def checkpoint_step(self, step: int) -> bool:
        """A checkpoint every ``checkpoint_every`` steps before the last (the last one: at the end)."""
        return self.checkpoint_every > 0 and step % self.checkpoint_every == 0 and step < self.steps


@dataclass(frozen=True)
class RegimeConfig(Options):
    """``regime.*``: the stress on the low-precision backward (``experiments/app/loop.py``): the
    backward runs on ``loss * m``, ``m = loss_multiplier``, times ``spike_factor`` on a spike step."""

    prefix: ClassVar[str] = "regime."

    name: str = hp(dataclasses.MISSING, _label, "conf/regime/<name>.yaml", "the regime's label in run records")
    loss_multiplier: float = hp(1.0, v.number(1e-12, 1e6), "scalelab",
                                "the loss is multiplied by this before scaling (the reported loss is not)")
    rescale_grads: bool = hp(True, v.flag, "scalelab", "divide the fp32 gradients by loss_multiplier after unscale_")
    spike_steps: frozenset[int] = hp(frozenset(), _steps, "scalelab",
                                     "steps whose backward loss is also multiplied by spike_factor")
    spike_factor: float = hp(1.0, v.number(0.0, 1e12, "(]"), "scalelab", "the extra multiplier of a spike step")
    primary: str = hp(schema.PRIMARY_DEFAULT, v.named(*schema.PRIMARY_BETTER), "scalelab; issue 30",
                      "the summary field reports rank this workload by (schema.PRIMARY_BETTER: which way is better); "
                      "declared by the workload (conf/workload/rl.yaml: final_reward)")

    def multiplier(self, step: int) -> float:
        """``m`` of ``step``: ``loss_multiplier``, times ``spike_factor`` on a spike step."""
        return self.loss_multiplier * (self.spike_factor if step in self.spike_steps else 1.0)


@dataclass(frozen=True)
class DistributedConfig(Options):
    """``distributed.*``: how a run of several ranks (torchrun, submitit tasks) spreads the model."""

    prefix: ClassVar[str] = "distributed."

    mode: str = hp("ddp", v.named("ddp", "fsdp2"), "torch DDP; torch FSDP2 (fully_shard)",
                   "ddp: every rank holds the model, gradients all-reduced | fsdp2: fully_shard on every layer "
                   "and the root, parameters and gradients sharded over the ranks (one process: ignored)")


@dataclass(frozen=True, kw_only=True)
class RunConfig(Options):
    """The run-level options of a composed config, validated (see the module docstring)."""

    seed: int = hp(0, v.whole(0), "scalelab", "seeds init and data order: runs of one seed are paired")
    device: str = hp("cpu", _text, "scalelab", "cpu | cuda (one GPU per rank) | cuda:N | auto")
    threads: Optional[int] = hp(None, v.optional(v.whole(1, 1024)), "torch.set_num_threads",
                                "intra-op CPU threads (null = torch default); use 1 per job for parallel CPU sweeps")
    sweep: str = hp("adhoc", _text, "scalelab", "sweep name: W&B group and summary.json sweep")
    cell: str = hp("", _text, "scalelab; issue 30", "label of a setting that is not a strategy option alone "
                   "(the court's -keep_head_fp32): summary.json cell; reports show strategy + cell as its own row")
    tags: tuple[str, ...] = hp((), _strings, "scalelab", "extra W&B tags")
    train: TrainConfig
    regime: RegimeConfig
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        steps = self.train.steps
        if any(s > steps for s in self.regime.spike_steps):
            raise ValueError(f"regime.spike_steps must be a list of steps in [1, train.steps={steps}], "
                             f"got {sorted(self.regime.spike_steps)}")

    @classmethod
    def from_hydra(cls, cfg: DictConfig) -> RunConfig:
        """The run options of the composed config ``cfg``, checked as a whole first (:func:`composed`)."""
        resolved = composed(cfg)
        run = {f.name: resolved[f.name] for f in dataclasses.fields(cls) if f.name in resolved}
        try:
            return cls(**{**run, "train": TrainConfig.from_node(run["train"]),
                          "regime": RegimeConfig.from_node(run["regime"]),
                          "distributed": DistributedConfig.from_node(run.get("distributed", {}))})
        except ValueError as exc:
            raise ConfigError(one_line(exc)) from None


def _optimizer_values(node: dict, path: str = "optimizer") -> None:
    """Every number of the optimizer config (lists included) is in [0, float32 max] (lr, betas, eps, ...):
    not NaN, not negative, and not so large that the optimizer's float32 arithmetic overflows."""
    for key, value in node.items():
        where = f"{path}.{key}"
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, (dict, list)):
                raise ConfigError(f"{where} must be a number or a list of numbers, got {value!r}")
            if isinstance(item, (int, float)) and not isinstance(item, bool) and not 0 <= item <= FLOAT32_MAX:
                raise ConfigError(f"{where} must be a finite number in [0, 3.4e+38] (float32), got {value!r}")


def composed(cfg: DictConfig) -> dict[str, Any]:
    """``cfg`` resolved, after the checks of the whole config, each a one-line ``ConfigError``: it
    resolves (interpolations such as ``${oc.env:X}`` included), each of :data:`GROUPS` is a mapping,
    no value is missing (``???``), model, data, strategy and optimizer each name a ``_target_``,
    every ``_target_`` is allowed (:func:`experiments.app.build.check_targets`) and every optimizer
    number is finite and >= 0. The groups' own values are checked by their constructors
    (``safe_instantiate`` turns those errors into one line)."""
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
        missing = sorted(k for k in OmegaConf.missing_keys(cfg) if not k.startswith("hydra."))
    except Exception as exc:  # noqa: BLE001 - any resolution failure is a bad value on the command line
        raise ConfigError(f"the configuration does not resolve: {one_line(exc)[:300]}") from None
    assert isinstance(resolved, dict)
    for group in GROUPS:
        if not isinstance(resolved.get(group), dict):
            raise ConfigError(f"config group {group!r} is missing or not a mapping")
    if missing:
        raise ConfigError(f"{', '.join(missing[:6])} {'has' if len(missing) == 1 else 'have'} no value (??? in the "
                          f"composed config): set {'it' if len(missing) == 1 else 'each'} on the command line, "
                          f"e.g. {missing[0]}=<value>")
    for group in _BUILT:  # built from their _target_: a partial group (one without it) is refused here
        if "_target_" not in resolved[group]:
            raise ConfigError(f"{group} has no _target_ (a partial {group} config: conf/{group}/<option>.yaml "
                              f"names the class to build); choose a complete {group}=<option>")
    check_targets(resolved, "")
    _optimizer_values(resolved["optimizer"])
    return resolved
