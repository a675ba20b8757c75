"""The run-record schema: file names, line kinds, keys and their types — one place, standard library only.

``experiments/`` writes run records through this module and ``analysis/`` reads them through it
(the one module of ``experiments`` that ``analysis`` imports; it imports neither side, nor torch).
``docs/run-records.md`` documents the same fields; a test keeps the two in step.

A run directory holds::

    summary.json     SUMMARY_FIELDS, written atomically at start (status "running") and at the end
    metrics.jsonl    one JSON object per line: TRAIN_FIELDS (kind "train"), EVAL_FIELDS (kind "eval")
                     or FIDELITY_FIELDS (kind "fidelity", every train.fidelity_every steps)
    trace.jsonl      the statistics trace: a TRACE_HEADER_FIELDS line, then TRACE_FIELDS chunks of
                     TRACE_COLUMNS rows, one row per step (format: strategies/tracing/trace.py)
    diagnosis.json   DIAGNOSIS_FIELDS: the doctor's verdict on the failing step of a stalled, diverged
                     or scale-floor run (strategies.doctor; written by experiments.doctor.diagnosis)
    replay.json      REPLAY_FIELDS: what every preset would have done on the trace of a failed or stalled
                     run, one REPLAY_ROW_FIELDS row each (written by scalelab-replay SWEEP_DIR --table)
    checkpoint.pt    model, optimizer, strategy, RNG, step, config (torch.load(weights_only=True))
    run.lock         held (flock) by the one process writing this directory, for the run's lifetime
    replaced-<n>/    the records of an earlier run moved aside by a start at step 0, renamed
                     ``<name>.old`` so that readers never take them for a run of their own

:func:`coerce` turns one untrusted value into its field's type or ``None`` (never raises): what a
reader does with a record written by an older version, a crashed run or a hostile hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = [
    "CHECKPOINT_NAME",
    "DIAGNOSIS_FIELDS",
    "DIAGNOSIS_NAME",
    "LOCK_NAME",
    "REPLACED_PREFIX",
    "REPLACED_SUFFIX",
    "REPLAY_FIELDS",
    "REPLAY_NAME",
    "REPLAY_ROW_FIELDS",
    "SEGMENT_KEYS",
    "EVAL_FIELDS",
    "FIDELITY_FIELDS",
    "Field",
    "METRICS_NAME",
    "PRIMARY_BETTER",
    "PRIMARY_DEFAULT",
    "STATUSES",
    "SUMMARY_FIELDS",
    "SUMMARY_NAME",
    "TRACE_COLUMNS",
    "TRACE_FIELDS",
    "TRACE_HEADER_FIELDS",
    "TRACE_NAME",
    "TRAIN_FIELDS",
    "coerce",
    "cell_of",
    "coerce_row",
    "primary_of",
]

METRICS_NAME = "metrics.jsonl"
SUMMARY_NAME = "summary.json"
CHECKPOINT_NAME = "checkpoint.pt"
DIAGNOSIS_NAME = "diagnosis.json"
TRACE_NAME = "trace.jsonl"
REPLAY_NAME = "replay.json"
LOCK_NAME = "run.lock"
REPLACED_PREFIX = "replaced-"
REPLACED_SUFFIX = ".old"

KIND_TRAIN = "train"
KIND_EVAL = "eval"
KIND_FIDELITY = "fidelity"
KIND_TRACE_HEADER = "trace_header"
KIND_TRACE = "trace"

STATUSES = ("running", "completed", "diverged", "failed", "stalled", "requeued")
"""``summary.json`` ``status`` values. ``running`` on disk after the process ended means the run was
killed; readers call such a run ``incomplete``. ``stalled``: the run stopped making progress, and
``error`` says why: the strategy skipped ``train.max_consecutive_skips`` steps in a row (the scale
collapsed), or ``forward overflow: ...`` (the loss itself was non-finite before scaling, on a
skipped step: no scale can help). ``requeued``: a submitit/SLURM job stopped by its preemption
signal and requeued; it resumes from its checkpoint, so readers count it as pending (like
``running``), not as failed."""


@dataclass(frozen=True)
class Field:
    """One key of a record: its name, its type and what it means.

    ``type`` is one of ``int``, ``float``, ``bool``, ``str``, ``"float_list"``, ``"str_list"``,
    ``"float_map"`` (layer name -> float), ``"dict"`` (a nested record), ``"list"`` (a list of
    nested records); ``optional`` fields may be absent or null.
    """

    name: str
    type: Any
    doc: str
    optional: bool = False


def _fields(*items: Field) -> dict[str, Field]:
    return {f.name: f for f in items}


TRAIN_FIELDS = _fields(
    Field("kind", str, '"train"'),
    Field("step", int, "optimizer steps attempted so far (1-based; skipped steps count)"),
    Field("loss", float, "training loss of this step (unscaled, without the regime's loss multiplier)"),
    Field("loss_avg", float, "mean training loss over the steps since the previous train line"),
    Field("scale", float, "the loss scale after update() (1.0 when scaling is off)"),
    Field("scales", "float_list", "per-group scales (per-layer strategies only)", optional=True),
    Field("scale_groups", "str_list", "names of those groups, same order", optional=True),
    Field("skipped", bool, "this step's optimizer step was skipped (non-finite gradients)"),
    Field("skipped_total", int, "skipped steps so far"),
    Field("grad_absmax", float, "abs-max of the unscaled parameter gradients"),
    Field("grad_norm", float, "L2 norm of the unscaled parameter gradients"),
    Field("grad_zero_frac", float, "fraction of parameter-gradient elements exactly zero (before unscaling)"),
    Field("grad_subnormal_frac", float, "fraction nonzero and below 2^-14 (before unscaling)"),
    Field("act_zero_frac", "float_map", "per layer: fraction of the activation gradient exactly zero"),
    Field("act_subnormal_frac", "float_map", "per layer: fraction below the precision's smallest normal"),
    Field("act_exp_hist", "dict", '{"lo": int, "counts": [int], "zeros": int}: exponent histogram', optional=True),
    Field("block_stats", "dict", "block-scaled modes: {layer: {role: {blocks, clipped_share, clip_error_share, "
          "flushed_share, zero_scale_share, scale_exp_hist: {lo, counts}}}} of the Linears' casts this step",
          optional=True),
    Field("lr", float, "learning rate"),
    Field("step_time_s", float, "wall time of the whole step"),
    Field("strategy_time_s", float, "wall time spent in the strategy, its boundary hooks included"),
    Field("probe_time_s", float, "cumulative wall time of a strategy's fp32 probes", optional=True),
    Field("telemetry", "dict", "the strategy's own telemetry beyond the keys above (e.g. ema, candidate)", optional=True),
    Field("reward", float, "rl workload: mean reward of the current rollout batch (sampled in the run's precision)",
          optional=True),
    Field("kl_ref", float, "rl workload: KL(policy || initial policy) per completion token of that batch, exact "
          "over the vocabulary, in fp32", optional=True),
)

EVAL_FIELDS = _fields(
    Field("kind", str, '"eval"'),
    Field("step", int, "step of the evaluation"),
    Field("eval_loss", float, "mean validation loss"),
    Field("eval_metric", float, "bits per character (text) or accuracy (classifiers)", optional=True),
    Field("eval_reward", float, "rl workload: mean reward of one sample per fixed evaluation prompt, sampled in the "
          "run's precision", optional=True),
)

FIDELITY_FIELDS = _fields(
    Field("kind", str, '"fidelity"'),
    Field("step", int, "step whose mixed-precision gradient was compared with the fp32 reference"),
    Field("cosine", float, "cosine similarity of the unscaled mixed-precision gradient and the fp32 gradient"),
    Field("rel_err", float, "||g_mp - g_fp32|| / ||g_fp32||"),
    Field("lost_frac", float, "fraction of entries nonzero in fp32 but exactly zero in mixed precision"),
    Field("layer_cosine", "float_map", "per layer: cosine"),
    Field("layer_rel_err", "float_map", "per layer: relative L2 error"),
    Field("layer_lost_frac", "float_map", "per layer: lost fraction"),
    Field("skipped", bool, "the step was skipped (non-finite gradients): no comparison", optional=True),
    Field("fidelity_probe_s", float, "wall time of this fidelity probe (not part of step or strategy time)"),
)

TRACE_HEADER_FIELDS = _fields(
    Field("kind", str, '"trace_header"'),
    Field("version", int, "the format's version (2; 1: rows without the act columns, read as NaN and -1)"),
    Field("groups", "str_list", "the layer groups of the per-group abs-maxes (layerwise's default groups, tied weights merged)"),
    Field("group_numel", "list", "parameter-gradient entries per layer group (ints)"),
    Field("scale_groups", "str_list", 'the recording strategy\'s scale groups: one per layer group for per-layer strategies, else ["all"]'),
    Field("format", "dict", "the activation-gradient format: name, max, smallest_normal, smallest_subnormal, saturates"),
    Field("meta", "dict", "strategy, precision, workload, seed, steps, log_every, hist_every of the run"),
    Field("act_modules", "str_list", "the hooked leaf modules, by name: act_module indexes them (empty: none hooked; "
          "absent in version 1)", optional=True),
    Field("act_max", float, "the forward format's largest finite value (fp16: 65504); null: no activations recorded "
          "(absent in version 1)", optional=True),
)

TRACE_FIELDS = _fields(
    Field("kind", str, '"trace"'),
    Field("step", int, "the step of the chunk's first row (rows are consecutive steps)"),
    Field("n", int, "rows in the chunk"),
    Field("width", int, "columns per row: TRACE_COLUMNS"),
    Field("data", str, "the rows as little-endian float32, row-major, base64"),
    Field("hist", "list", "[{step, lo, counts, zeros}]: the activation-gradient exponent histograms measured "
          "in these steps (act_exp_hist's), at the step's scale", optional=True),
)

TRACE_COLUMNS = _fields(
    Field("found_inf", float, "1.0 when the step's gradients were non-finite (skipped), else 0.0"),
    Field("loss", float, "training loss (non-finite: the forward overflowed or the data held a NaN)"),
    Field("grad_absmax", float, "abs-max of the unscaled parameter gradients (the statistics the rule read)"),
    Field("grad_sumsq", float, "their sum of squares"),
    Field("zero_frac", float, "fraction of parameter-gradient entries exactly zero, as they arrived"),
    Field("subnormal_frac", float, "fraction nonzero and below 2^-14, as they arrived"),
    Field("lr", float, "learning rate"),
    Field("scale.<i>", float, "the scale the step ran at, one per scale group"),
    Field("group_absmax.<i>", float, "abs-max of the unscaled parameter gradients of layer group i"),
    Field("act_absmax", float, "abs-max of the finite entries of the step's low-precision forward activations (every "
          "leaf module's output; NaN: not recorded)"),
    Field("act_module", float, "index in act_modules of the module holding act_absmax (-1: not recorded)"),
)

SUMMARY_FIELDS = _fields(
    Field("status", str, "one of STATUSES"),
    Field("error", str, "one-line reason when not completed", optional=True),
    Field("strategy", str, "strategy option chosen (conf/strategy/<option>.yaml; a rule or a preset), or none (no scaling)"),
    Field("precision", str, "fp32, fp16, bf16, fp8_e4m3, fp8_e5m2"),
    Field("model", str, "config-group choice"),
    Field("data", str, "config-group choice"),
    Field("regime", str, "stress regime name"),
    Field("workload", str, '"{model}/{data}/{regime}": the unit a report compares within'),
    Field("seed", int, "seed (fixes init and data order: runs of one seed are paired)"),
    Field("sweep", str, "sweep / W&B group name"),
    Field("steps", int, "steps completed"),
    Field("final_train_loss", float, "loss_avg of the last train line", optional=True),
    Field("final_eval_loss", float, "eval loss at the end", optional=True),
    Field("best_eval_loss", float, "lowest eval loss", optional=True),
    Field("final_eval_metric", float, "eval metric at the end", optional=True),
    Field("final_reward", float, "rl workload: eval_reward at the end (the court's primary metric for rl)",
          optional=True),
    Field("primary", str, "the summary field this run's workload is ranked by (its regime.primary, declared by "
          "the workload: a key of PRIMARY_BETTER, which says whether higher or lower is better)", optional=True),
    Field("skipped_steps", int, "optimizer steps skipped"),
    Field("mean_step_time_s", float, "mean step time after warm-up", optional=True),
    Field("strategy_overhead_s", float, "mean per-step strategy time", optional=True),
    Field("strategy_overhead_frac", float, "strategy_overhead_s / mean_step_time_s", optional=True),
    Field("fidelity_one_minus_cos_mean", float, "mean of 1 - cosine over the run's fidelity probes", optional=True),
    Field("fidelity_rel_err_mean", float, "mean relative error over the fidelity probes", optional=True),
    Field("fidelity_lost_frac_mean", float, "mean lost fraction over the fidelity probes", optional=True),
    Field("fidelity_time_s", float, "total wall time of the fidelity probes", optional=True),
    Field("diagnosis", str, "the doctor's cause (one of strategies.doctor.CAUSES) when it diagnosed the run", optional=True),
    Field("diverged", bool, "status == diverged"),
    Field("survived", bool, "status == completed: the run trained to its last step (not diverged, stalled or "
          "failed); a running summary says false"),
    Field("cell", str, "the experiment's label of a setting that is not a strategy option alone (the run "
          "option cell, e.g. the court's -keep_head_fp32): the run is its own row, strategy + cell", optional=True),
    Field("keep_fp32", "str_list", "modules the model ran in fp32 under autocast (model.keep_fp32; the "
          "keep-module-in-fp32 remedy)", optional=True),
    Field("fingerprint", "dict", "git_sha, git_dirty, config, overrides, torch_version, device, hostname"),
    Field("segments", "list", "one entry per process that ran part of the run, oldest first: start_step "
          "(the checkpoint step it resumed from, 0 for the first), steps (its train.steps), git_sha, git_dirty, "
          "torch_version, device, hostname (SEGMENT_KEYS)", optional=True),
)

PRIMARY_BETTER = {"final_eval_loss": "lower", "final_reward": "higher"}
"""The summary fields a workload may be ranked by (``regime.primary``) and which way is better:
the eval loss (lower), the rl workload's final reward (higher; issue 30's court)."""
PRIMARY_DEFAULT = "final_eval_loss"


def primary_of(summary: Mapping[str, Any]) -> str:
    """The primary metric of a run from its summary: its ``primary`` where it is a key of
    :data:`PRIMARY_BETTER`; for a record written before that field existed, ``final_reward``
    where the summary holds one (only the rl workload wrote it, and ranked by it), else
    :data:`PRIMARY_DEFAULT`."""
    named = summary.get("primary")
    if isinstance(named, str) and named in PRIMARY_BETTER:
        return named
    return "final_reward" if _number(summary.get("final_reward")) is not None else PRIMARY_DEFAULT


def cell_of(summary: Mapping[str, Any]) -> str:
    """The run's ``cell`` label from its summary; for a record written before that field existed,
    the ``cell`` of the resolved config in its ``fingerprint`` (the court set it there); else ``""``."""
    named = summary.get("cell")
    if isinstance(named, str):
        return named
    fingerprint = summary.get("fingerprint")
    config = fingerprint.get("config") if isinstance(fingerprint, Mapping) else None
    named = config.get("cell") if isinstance(config, Mapping) else None
    return named if isinstance(named, str) else ""


SEGMENT_KEYS = ("start_step", "steps", "git_sha", "git_dirty", "torch_version", "device", "hostname")
"""The keys of one ``segments`` entry of ``summary.json`` (and of the checkpoint's ``segments``)."""

DIAGNOSIS_FIELDS = _fields(
    Field("status", str, "the run's status when the doctor ran (diverged, stalled or failed)"),
    Field("step", int, "the failing step (the batch diagnosed)"),
    Field("error", str, "one-line reason the doctor could not run (then no verdict keys)", optional=True),
    Field("cause", str, "one of strategies.doctor.CAUSES", optional=True),
    Field("verdict", str, "the verdict in words", optional=True),
    Field("fix", str, "the fix, with its evidence in evidence", optional=True),
    Field("precision", str, "fp16 or bf16", optional=True),
    Field("scale", float, "the loss scale diagnosed (the strategy's at the failing step)", optional=True),
    Field("first_module", str, "the first module whose output or gradient left the format's range", optional=True),
    Field("tensor", str, "which tensor of it (output, activation or parameter gradient)", optional=True),
    Field("value", float, "its value (fp32 recomputation; lost fraction for underflow)", optional=True),
    Field("evidence", "str_list", "the measurements the verdict rests on, one line each", optional=True),
    Field("per_layer", "list", "per layer and scale: lost fraction and cosine against fp32", optional=True),
    Field("strategy_scales", "float_map", "the scale each registered strategy would choose", optional=True),
    Field("not_compared", "dict", "strategies not compared, with the reason", optional=True),
    Field("passes", "dict", "forward and backward passes the doctor ran", optional=True),
    Field("exit_code", int, "scalelab-doctor's exit code for this cause", optional=True),
)


REPLAY_FIELDS = _fields(
    Field("why", str, "why the run counts as failed or stalled: its status (diverged, stalled, failed), its scale "
          "at its strategy's min_scale, or skipping >= 10% of its steps; '; '-joined"),
    Field("recorded", str, "the strategy that recorded the trace"),
    Field("precision", str, "the trace's activation-gradient format"),
    Field("steps", int, "steps in the trace"),
    Field("skipped", int, "steps the recorded run skipped"),
    Field("final_scale", float, "the scale the recorded run's last step ran at", optional=True),
    Field("overflow", str, "the replay's overflow model (auto, persist, bound)"),
    Field("presets", "list", "one REPLAY_ROW_FIELDS row per preset replayed"),
)

REPLAY_ROW_FIELDS = _fields(
    Field("strategy", str, "the conf/strategy option replayed"),
    Field("steps", int, "steps replayed (fewer than the trace's when the preset stops at its floor)", optional=True),
    Field("skipped", int, "steps it would have skipped", optional=True),
    Field("min_scale", float, "the lowest scale it reaches", optional=True),
    Field("min_scale_step", int, "the first step that runs at it", optional=True),
    Field("floor", float, "its min_scale (absent: none)", optional=True),
    Field("floor_steps", int, "steps it runs at its floor", optional=True),
    Field("final_scale", float, "the scale of its last replayed step", optional=True),
    Field("stopped", str, "why it stops early (on_min_scale: raise), one line", optional=True),
    Field("unreplayable", str, "why it cannot be replayed on a trace (e.g. it needs the fp32 probe); then "
          "no numbers", optional=True),
)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond float range (|x| >= 2**1024) is not a usable number
        return None


def coerce(field: Field, value: Any) -> Any:
    """``value`` as ``field``'s type, or ``None`` when it is absent or of the wrong shape.

    Floats keep NaN/±Inf (they are data: a diverged loss); ints must be integral and finite;
    strings stay strings (never interpreted); maps keep only str -> number entries.
    """
    t = field.type
    if value is None:
        return None
    if t is float:
        return _number(value)
    if t is int:
        x = _number(value)
        return int(x) if x is not None and math.isfinite(x) and x.is_integer() else None
    if t is bool:
        return value if isinstance(value, bool) else None
    if t is str:
        return value if isinstance(value, str) else None
    if t == "float_list":
        if not isinstance(value, list):
            return None
        out = [_number(v) for v in value]
        return None if any(v is None for v in out) else out
    if t == "str_list":
        return list(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else None
    if t == "float_map":
        if not isinstance(value, Mapping):
            return None
        return {str(k): x for k, v in value.items() if (x := _number(v)) is not None}
    if t == "dict":
        return dict(value) if isinstance(value, Mapping) else None
    if t == "list":
        return list(value) if isinstance(value, list) else None
    raise AssertionError(f"unknown field type {t!r}")


def coerce_row(fields: Mapping[str, Field], row: Mapping[str, Any]) -> dict[str, Any]:
    """Every known key of ``row`` coerced (bad values become ``None``); unknown keys are dropped."""
    return {name: coerce(f, row.get(name)) for name, f in fields.items() if name in row}
