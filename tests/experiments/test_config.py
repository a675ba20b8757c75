"""Compose-API tests: every option of every config group composes and builds; bad values are
refused with one-line errors naming the option; ``instantiate`` is restricted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
import torch

import strategies
from experiments.app.build import (
    ConfigError,
    build_data,
    build_model,
    build_optimizer,
    build_precision,
    build_strategy,
    check_targets,
    instantiate_loggers,
    strategy_label,
)
from experiments.app.config import RunConfig
from experiments.app.loggers import RunInfo
from experiments.workloads.precision import Precision
from experiments.app.train import CONF_DIR, GROUPS, group_options
from tests.experiments.runs import QUIET, REPO, TINY, cli, compose_cfg

# Which tiny model goes with each data option, and which data with each model option.
def tiny_for_model(option: str) -> str:
    """The TINY settings of a model option: those of its class (conf/model/<option>.yaml's
    ``_target_``), so a new model YAML joins this test with no edit here."""
    cfg = yaml.safe_load((Path(CONF_DIR) / "model" / f"{option}.yaml").read_text())
    if "_target_" not in cfg:  # a variant of another model YAML (its defaults list)
        return tiny_for_model(next(d for d in cfg["defaults"] if d != "_self_"))
    return cfg["_target_"].rsplit(".", 1)[-1].lower()


MODEL_FOR_DATA = {"stdlib_chars": "gpt", "vectors": "mlp", "images": "cnn", "finetune_chars": "pretrainedgpt",
                  "rl_vowels": "rl"}
_RUN = RunInfo(run_dir=Path("/nonexistent"), run_id="test", config={}, group="g", job_type="j", name="n")


def _cases() -> list[tuple[str, str]]:
    return [(group, option) for group in GROUPS for option in group_options(group)]


def test_every_group_has_its_options() -> None:
    assert {"gpt", "mlp", "cnn"} <= set(group_options("model"))
    assert {"stdlib_chars", "vectors", "images"} <= set(group_options("data"))
    assert set(group_options("precision")) == {"fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "fp8_hybrid"}
    assert {"none", "native"} <= set(group_options("strategy"))
    assert {"plain", "small_grad"} <= set(group_options("regime"))
    assert set(group_options("logger")) == {"wandb", "none"}


@pytest.mark.filterwarnings("ignore:norm_ratio. no reference closure")  # the loop supplies one; this test does not
@pytest.mark.parametrize("group,option", _cases())
def test_every_option_composes_and_builds(group: str, option: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    if group == "model":
        tiny = TINY[tiny_for_model(option)]
    elif group == "data":
        tiny = TINY[MODEL_FOR_DATA[option]]
    else:
        tiny = TINY["mlp"]
    cfg = compose_cfg(*tiny, *QUIET, f"{group}={option}")
    RunConfig.from_hydra(cfg)
    precision = build_precision(cfg)
    data = build_data(cfg)
    model = build_model(cfg, data)
    optimizer = build_optimizer(cfg, model.parameters())
    strategy = build_strategy(cfg)
    assert isinstance(precision, Precision) and precision.name == cfg.precision.name
    assert isinstance(model, torch.nn.Module) and model.boundaries
    assert all(model.get_submodule(name) is not None for name in model.boundaries)
    assert isinstance(optimizer, torch.optim.AdamW)
    # One forward/backward through the built objects, so "builds" means "works together".
    x, y = data.batch(4, torch.Generator().manual_seed(0))
    with precision.autocast_context(torch.device("cpu")):
        logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    strategy.scale(loss).backward()
    strategy.step(optimizer)
    strategy.update()
    assert torch.isfinite(loss)
    if group == "strategy":
        assert cfg.strategy._target_ == "strategies.create"
        assert cfg.strategy.name in strategies.available()
        assert strategy.is_enabled() == (option != "none")
        assert strategy_label(cfg) == ("none" if option == "none" else cfg.strategy.name)
    if group == "precision":
        assert precision.max > precision.smallest_normal > 0
    if group == "logger":
        loggers = instantiate_loggers(cfg.logger, _RUN)
        assert [type(lg).__name__ for lg in loggers] == (["WandbLogger"] if option == "wandb" else [])


def test_precision_files_carry_their_formats_range() -> None:
    for name, dtype in [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32),
                        ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]:
        p = build_precision(compose_cfg(f"precision={name}"))
        info = torch.finfo(dtype)
        assert p.max == pytest.approx(info.max, rel=1e-6)
        assert p.smallest_normal == pytest.approx(info.smallest_normal, rel=1e-6)


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.steps=0", "train.steps must be an integer >= 1, got 0"),
        ("regime.loss_multiplier=0", "regime.loss_multiplier must be a number in [1e-12, 1e+06], got 0"),
        ("train.log_every=0", "train.log_every must be an integer >= 1, got 0"),
        ("regime.spike_steps=[1000]", "regime.spike_steps must be a list of steps in [1, train.steps=150]"),
        ("train.divergence_loss=-1", "train.divergence_loss must be a number in (0, inf]"),
    ],
)
def test_out_of_range_values_are_one_line_errors(override: str, needle: str) -> None:
    cfg = compose_cfg("logger=wandb", override)
    with pytest.raises(ConfigError) as err:
        RunConfig.from_hydra(cfg)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_logger_options_are_checked_when_built() -> None:
    cfg = compose_cfg("logger=wandb", "logger.wandb.mode=sometimes")
    with pytest.raises(ConfigError, match=r"^logger.wandb: mode must be online, offline or disabled, got 'sometimes'$"):
        instantiate_loggers(cfg.logger, _RUN)


def test_constructor_errors_name_the_group() -> None:
    cfg = compose_cfg(*TINY["mlp"], "strategy=native", "strategy.growth_factor=0.5")
    with pytest.raises(ConfigError, match=r"^strategy: .*growth_factor.*0\.5") as err:
        build_strategy(cfg)
    assert "\n" not in str(err.value)
    cfg = compose_cfg(*TINY["mlp"], "model.activation=swish")
    with pytest.raises(ConfigError, match=r"model: model.activation must be one of relu, gelu, tanh, got 'swish'"):
        build_model(cfg, build_data(cfg))


def test_model_data_mismatch_names_both_choices() -> None:
    cfg = compose_cfg(*TINY["mlp"], "model=cnn")
    with pytest.raises(ConfigError, match=r"model=cnn cannot train on data=vectors .*accepts data of kind: images"):
        build_model(cfg, build_data(cfg))


def test_shape_arguments_come_from_the_data() -> None:
    cfg = compose_cfg(*TINY["cnn"], "model=mlp", "data.in_channels=3")
    data = build_data(cfg)
    model = build_model(cfg, data)
    assert model.layers[0][0].in_features == 3 * 8 * 8 and model.head.out_features == data.num_classes


@pytest.mark.parametrize(
    "target,needle",
    [
        ("os.system", "is not allowed (resolves to posix.system); allowed: strategies.create, torch.optim."),
        ("builtins.eval", "is not allowed (resolves to builtins.eval)"),
        ("torch.load", "is not allowed (resolves to torch.serialization.load)"),
        ("torch.hub.load", "is not allowed (resolves to torch.hub.load)"),
        ("torch.NoSuchThing", "is not allowed (names nothing the app loads)"),
        ("torch.optim.Optimizer", "is not allowed (resolves to torch.optim.optimizer.Optimizer)"),
        ("torch.nn.Linear", "is not allowed (resolves to torch.nn.modules.linear.Linear)"),
        # Issue 13 case 5: project-prefixed aliases of functions that load pickles or write files.
        ("experiments.app.checkpoint.torch.load", "is not allowed (resolves to torch.serialization.load)"),
        ("experiments.app.records.write_json_atomic", "is not allowed (resolves to experiments.app.records.write_json_atomic)"),
        ("strategies.registry.__builtins__", "is not allowed"),
        ("antigravity.fly", "is not allowed (names nothing the app loads)"),  # and it is never imported
    ],
)
def test_instantiate_refuses_foreign_targets(target: str, needle: str) -> None:
    import sys

    import experiments.app.checkpoint  # noqa: F401 - loaded in the app, so its alias resolves

    cfg = compose_cfg(*TINY["mlp"], f"optimizer._target_={target}")
    with pytest.raises(ConfigError, match=f"optimizer._target_='{target}'") as err:
        build_optimizer(cfg, [torch.nn.Parameter(torch.zeros(1))])
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert "antigravity" not in sys.modules


REFUSED_TARGETS = ["torch._dynamo.foo", "torch._inductor.config", "torch.onnx.export", "os.system",
                   "torch.distributed.run.main", "experiments.app.checkpoint.torch._dynamo.reset",
                   "strategies.doctor.diagnose", "torch.optim.Optimizer.__init__.__globals__"]


def test_judging_a_refused_target_imports_nothing() -> None:
    """Issue 29: resolving ``torch._dynamo.foo`` to refuse it imported ``torch._dynamo`` (torch's
    lazy module ``__getattr__``). In a fresh process, every refusal leaves ``sys.modules`` as it was."""
    code = ("import sys, json\n"
            "from experiments.app.build import ConfigError, check_targets\n"
            "import experiments.app.checkpoint\n"
            f"targets = {REFUSED_TARGETS!r}\n"
            "before = set(sys.modules)\n"
            "out = []\n"
            "for t in targets:\n"
            "    try:\n"
            "        check_targets({'_target_': t}, 'optimizer')\n"
            "        out.append([t, 'accepted'])\n"
            "    except ConfigError as exc:\n"
            "        out.append([t, str(exc)])\n"
            "print(json.dumps({'new': sorted(set(sys.modules) - before), 'out': out}))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["new"] == []
    for target, message in result["out"]:
        assert message.startswith(f"optimizer._target_={target!r} is not allowed ("), message


@pytest.mark.parametrize("group", ["strategy", "model", "data", "optimizer"])
def test_every_group_refuses_a_file_writing_target(group: str, tmp_path: Path) -> None:
    """``strategy._target_=experiments.app.records.write_json_atomic`` and the like fail in RunConfig.from_hydra(),
    before anything is built or written."""
    victim = tmp_path / "victim.json"
    cfg = compose_cfg(*TINY["mlp"], f"{group}._target_=experiments.app.records.write_json_atomic",
                      f"+{group}.path={victim}", f"+{group}.obj=pwned")
    with pytest.raises(ConfigError, match=f"^{group}._target_='experiments.app.records.write_json_atomic' is not allowed"):
        RunConfig.from_hydra(cfg)
    assert not victim.exists()


def test_nested_targets_are_checked_too() -> None:
    with pytest.raises(ConfigError, match=r"^data.inner\[0\]._target_='subprocess.run' is not allowed"):
        check_targets({"_target_": "experiments.workloads.data.CharData", "inner": [{"_target_": "subprocess.run"}]}, "data")
    check_targets({"_target_": "torch.optim.SGD", "x": {"_target_": "strategies.create"}}, "ok")


def test_records_name_the_strategy_option_chosen_not_the_rule_it_presets() -> None:
    """A preset (e.g. megatron.yaml: name native with Megatron's defaults) must not be recorded as native."""
    cfg = compose_cfg("strategy=native")
    assert strategy_label(cfg) == "native"
    assert strategy_label(cfg, {"strategy": "megatron"}) == "megatron"
    assert strategy_label(compose_cfg("strategy=none"), {"strategy": "none"}) == "none"
    assert strategy_label(compose_cfg("strategy=native", "strategy.enabled=false"), {"strategy": "native"}) == "none"


def test_an_interpolation_that_does_not_resolve_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SCALELAB_SURELY_UNSET", raising=False)
    with pytest.raises(ConfigError, match=r"^the configuration does not resolve: ") as err:
        RunConfig.from_hydra(compose_cfg("seed=${oc.env:SCALELAB_SURELY_UNSET}"))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["~model._target_"], "model has no _target_ (a partial model config: "),
    (["model=mlp", "data=vectors", "~data._target_"], "data has no _target_ (a partial data config: "),
    (["model.n_embd=???"], "model.n_embd has no value (??? in the composed config): set it on the command line"),
    (["model.n_embd=???", "model.n_head=???"], "model.n_embd, model.n_head have no value"),
])
def test_a_partial_group_config_is_one_line_before_hydra_writes(tmp_path: Path, overrides: list[str],
                                                               message: str) -> None:
    """Issue 29: a model or data group without its ``_target_`` or with a value left ``???`` ended in
    a Python traceback (``KeyError: '_target_'``, ``MissingMandatoryValue``) once Hydra had started."""
    run_dir = tmp_path / "run"
    proc = cli(*overrides, *QUIET, "train.steps=1", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"scalelab-train: error: {message}"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert not run_dir.exists()
    with pytest.raises(ConfigError) as err:
        RunConfig.from_hydra(compose_cfg(*overrides))
    assert str(err.value).startswith(message)
