"""Hostile command-line overrides (issue 13): random keys of every config group set to random
hostile values — NaN, -1, huge, strings, lists, nested dicts, ``${oc.env:...}``, ``_target_``s.
Every run must end with a result (exit 0) or a one-line error (exit 2), never a traceback.

In-process, as ``main()`` does it: :func:`check_overrides`, :func:`preflight`, then
:func:`experiments.app.loop.run`, where only ``AppError``/``ConfigError`` (Hydra prints their one-line
message and the app exits 2) may escape. A fixed, seeded sample runs in CI; a larger one is slow.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from experiments import schema
from experiments.app.build import AppError
from experiments.app.loop import run
from experiments.app.train import check_overrides, preflight
from tests.experiments.runs import QUIET, TINY, cli, compose_cfg

BASE = [*TINY["mlp"], *QUIET, "train.steps=3", "train.log_every=1", "train.eval_every=0", "train.hist_every=1"]
HOSTILE = [
    "nan", "-nan", "inf", "-1", "-1e-300", "0", "1e300", "1000000000000000000000000000000",
    "'a hostile string'", "''", "null", "true", "[1,2,3]", "[]", "[nan,-1]", "{a:1}", "{a:{b:[1,{c:2}]}}",
    "${oc.env:HOME}", "${oc.env:SCALELAB_FUZZ_UNSET}", "'${oc.env:HOME}'", "'$\\\\foo$'", "'<b>x</b>'",
    "1", "2", "0.5",  # plausible values too, so that some samples train
]
TARGETS = [
    "os.system", "builtins.eval", "experiments.app.checkpoint.torch.load", "experiments.app.records.write_json_atomic",
    "torch.load", "torch.optim.SGD", "torch.nn.Linear", "strategies.create", "experiments.workloads.models.MLP",
    "experiments.workloads.data.CharData", "experiments.app.loggers.WandbLogger", "subprocess.run", "no.such.module",
]
GROUPS = ("model", "data", "precision", "strategy", "regime", "optimizer", "train", "logger", "")


def _leaves(node: object, prefix: str) -> list[str]:
    if isinstance(node, dict):
        out = []
        for key, value in node.items():
            out += _leaves(value, f"{prefix}.{key}" if prefix else str(key))
        return out
    return [prefix]


def _keys(logger: str) -> dict[str, list[str]]:
    cfg = OmegaConf.to_container(compose_cfg(*BASE, f"logger={logger}", "strategy=max_ema"), resolve=False)
    assert isinstance(cfg, dict)
    keys = {g: _leaves(cfg[g], g) for g in GROUPS if g}
    keys[""] = [k for k in cfg if not isinstance(cfg[k], dict)]
    keys["train"] = [k for k in keys["train"] if k != "train.kill_at_step"]  # a test aid that SIGKILLs
    return keys


def _sample(rng: random.Random, keys: dict[str, list[str]]) -> list[str]:
    out = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        group = rng.choice(GROUPS)
        key = rng.choice(keys[group] + ([f"{group}._target_"] if group not in ("", "train", "regime", "precision") else []))
        value = rng.choice(TARGETS) if key.endswith("_target_") and rng.random() < 0.8 else rng.choice(HOSTILE)
        out.append(f"{key}={value}")
    return out


def _run_one(args: list[str], run_dir: Path) -> tuple[str, str]:
    """("ok", status) or ("error", message) — anything else escapes and fails the test."""
    error = check_overrides(args) or preflight(args)
    if error is not None:
        return "error", error
    try:
        summary = run(compose_cfg(*args), run_dir, args)
    except AppError as exc:  # ConfigError included: what Hydra prints as one line, exit 2
        return "error", str(exc)
    return "ok", summary["status"]


def _fuzz(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, n: int) -> list[tuple[str, str]]:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.delenv("SCALELAB_FUZZ_UNSET", raising=False)
    monkeypatch.chdir(tmp_path)  # preflight checks the default run dir (runs/...) below here
    rng = random.Random(seed)
    keysets = {name: _keys(name) for name in ("none", "wandb")}
    results = []
    for i in range(n):
        logger = rng.choice(["none", "wandb"])
        strategy = rng.choice(["native", "max_ema", "layerwise", "norm_ratio", "none"])
        sample = _sample(rng, keysets[logger])
        args = [*BASE, f"logger={logger}", f"strategy={strategy}", *sample]
        victim = tmp_path / "victim.json"
        try:
            kind, text = _run_one(args, tmp_path / f"run{i}")
        except BaseException as exc:  # noqa: BLE001 - report the override that escaped
            raise AssertionError(f"{sample!r} (strategy={strategy}) raised {type(exc).__name__}: {exc}") from exc
        assert "\n" not in text and text, (sample, text)
        assert kind == "error" or text in schema.STATUSES, (sample, text)
        assert not victim.exists()
        results.append((kind, text))
    return results


def test_hostile_overrides_end_in_a_result_or_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = _fuzz(tmp_path, monkeypatch, seed=13, n=24)
    kinds = [k for k, _ in results]
    assert "error" in kinds and "ok" in kinds  # the sample exercises both ends


@pytest.mark.slow
def test_many_hostile_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fuzz(tmp_path, monkeypatch, seed=2026, n=400)


@pytest.mark.parametrize(
    "override",
    ["strategy._target_=experiments.app.checkpoint.torch.load", "optimizer.lr=nan", "seed=${oc.env:SCALELAB_FUZZ_UNSET}",
     "model.width={a:{b:1}}"],
)
def test_the_cli_prints_one_line_and_exits_2(tmp_path: Path, override: str) -> None:
    result = cli(*BASE, override, f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scalelab-train: error: ") and "Traceback" not in result.stderr
    if override.startswith("model."):  # a constructor's check: found while building, before any record
        assert not (tmp_path / "run" / schema.SUMMARY_NAME).exists()
    else:  # found by preflight, before Hydra created the directory
        assert not (tmp_path / "run").exists()
