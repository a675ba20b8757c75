"""The labelled fault suite (``experiments/doctor/cases.py``, scored by ``experiments/doctor/evaluate.py``): every case gets the right cause and,
where construction defines one, the right first module; the HF-style forward-hook baseline and the
minimum-scale line are computed for real."""

from __future__ import annotations

import pytest
import torch

import strategies.doctor
from experiments.doctor import cases as doctor_cases, evaluate as doctor_eval
from strategies.doctor import CAUSES, DECISIONS, decision_list

CASES = doctor_cases.cases()


def test_every_cause_has_cases_over_several_seeds_and_sizes() -> None:
    for cause in CAUSES:
        names = [c.name for c in CASES if c.cause == cause]
        assert len(names) >= 6, cause
        assert len({n.split("/s")[-1] for n in names}) == len(doctor_cases.SEEDS), cause
        assert len({n.rsplit("/", 1)[0] for n in names}) >= 2, cause  # two sizes (or kinds) at least


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_doctor_names_the_planted_cause_and_module(case: doctor_cases.Case) -> None:
    result = doctor_eval.run_case(case)
    assert result.diagnosis.cause == case.cause
    if case.module is not None:
        assert result.diagnosis.first_module == case.module


def test_hf_forward_hook_sees_forward_overflow_only() -> None:
    forward = next(c for c in CASES if c.name.startswith("ffn_overflow"))
    backward = next(c for c in CASES if c.cause == "gradient_overflow")
    model, loss_fn, batch, _ = forward.build()
    assert doctor_eval.hf_forward_hook_first(model, loss_fn, batch) == "blocks.0.fc_out"
    model, loss_fn, batch, _ = backward.build()
    assert doctor_eval.hf_forward_hook_first(model, loss_fn, batch) is None
    assert doctor_eval.min_scale_line(model, loss_fn, batch)  # overflows at S = 1: the line fires


def test_min_scale_line_stays_silent_where_backing_off_helps() -> None:
    case = next(c for c in CASES if c.cause == "scale_overflow")
    model, loss_fn, batch, _ = case.build()
    assert not doctor_eval.min_scale_line(model, loss_fn, batch)


def test_table_counts_what_it_measured() -> None:
    results = [doctor_eval.run_case(c) for c in doctor_cases.cases(seeds=(0,))]
    table = doctor_eval.table(results)
    cause_acc, module_acc = doctor_eval.accuracy(results)
    n = len(results)
    assert f"| **all** | {n} | {100 * cause_acc:.0f}% ({sum(r.cause_ok for r in results)}/{n})" in table
    # A wrong verdict is counted as one.
    results[0].diagnosis.cause = "healthy" if results[0].case.cause != "healthy" else "underflow"
    assert doctor_eval.accuracy(results)[0] == pytest.approx(cause_acc - 1 / n)
    assert doctor_eval.misses(results)[0].startswith(results[0].case.name)


def test_docs_are_generated_from_the_results(tmp_path) -> None:
    results = [doctor_eval.run_case(c) for c in doctor_cases.cases(seeds=(0,))]
    path = tmp_path / "doctor.md"
    doctor_eval.write_docs(path, doctor_eval.table(results), results)
    text = path.read_text()
    assert doctor_eval.table(results) in text and "Minimum loss scale reached" in text
    assert "| forward_overflow | 3 |" in text and "`blocks.0.fc_out`" in text
    assert decision_list() in text
    torch.manual_seed(0)


def test_the_decision_list_is_data_one_decision_per_cause_rendered_once() -> None:
    """The doctor's docstring and docs/doctor.md show the list rendered from ``DECISIONS``; the
    last decision (``healthy``) holds for every step."""
    assert sorted(d.cause for d in DECISIONS) == sorted(CAUSES)
    assert DECISIONS[-1].cause == "healthy" and DECISIONS[-1].holds(None)  # type: ignore[arg-type]
    rendered = decision_list()
    assert rendered.startswith("1. ``nan_in_data_or_loss`` — ")
    assert rendered.endswith("9. ``healthy`` — none of the above.")
    assert rendered in (strategies.doctor.__doc__ or rendered)


def test_min_scale_line_fires_on_an_overflow_kept_in_grad() -> None:
    """The scaler checks .grad, which a loop that never clears it still holds an overflow in."""
    case = next(c for c in CASES if c.name.startswith("overflow_kept_in_grad"))
    model, loss_fn, batch, _ = case.build()
    assert doctor_eval.min_scale_line(model, loss_fn, batch)
    for p in model.parameters():
        p.grad = None
    assert not doctor_eval.min_scale_line(model, loss_fn, batch)
