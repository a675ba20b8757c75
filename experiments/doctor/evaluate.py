"""The doctor's accuracy on its labelled fault suite (``experiments/doctor/cases.py``), beside
what other tools would have said: ``make doctor-eval`` prints the table and writes
``docs/doctor.md`` from it.

Baselines, computed on the same cases: ``torch.amp.GradScaler`` (skips the step and halves the
scale: it tells the user nothing); DeepSpeed / fairseq / Megatron (their "Current loss scale
already at minimum" / "Minimum loss scale reached" line fires when the same step still
overflows at their minimum scale 1, i.e. when the mixed gradient is non-finite at S = 1: we run
that step); HF's ``DebugUnderflowOverflow`` (forward hooks; reports the first module whose
output has inf/nan: :func:`hf_forward_hook_first`, run for real).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from experiments.app.records import write_text_atomic
from experiments.doctor.cases import SEEDS, Case, cases
from strategies.doctor import CAUSES, EXIT_CODES, Diagnosis, decision_list, diagnose

__all__ = ["APP", "DOCS", "USAGE", "Result", "accuracy", "accuracy_section", "evaluate", "exit_codes",
           "hf_forward_hook_first", "main", "min_scale_line", "misses", "page", "run_case", "side_by_side", "table",
           "write_docs"]

DOCS = Path(__file__).resolve().parents[2] / "docs" / "doctor.md"


def hf_forward_hook_first(model: torch.nn.Module, loss_fn: Callable, batch: Any, precision: str = "fp16") -> str | None:
    """What HF's ``DebugUnderflowOverflow`` reports: forward hooks on every module, the first
    module (in completion order) whose output holds inf or nan, in the mixed forward."""
    names = {id(m): n for n, m in model.named_modules()}
    first: list[str] = []

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        outs = output if isinstance(output, (tuple, list)) else (output,)
        if not first and any(isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())
                             for t in outs):
            first.append(names[id(module)])

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        dtype = torch.float16 if precision == "fp16" else torch.bfloat16
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            loss_fn(model, batch)
    finally:
        for h in handles:
            h.remove()
    return first[0] if first else None


def min_scale_line(model: torch.nn.Module, loss_fn: Callable, batch: Any, precision: str = "fp16") -> bool:
    """Would DeepSpeed/fairseq/Megatron print "Minimum loss scale reached"? Their scale halves on
    every overflow down to the minimum 1; the line fires when the step still overflows there:
    the gradient the scaler checks at S = 1 is non-finite: this step's mixed gradient plus what
    ``.grad`` already held (a loop that never clears it keeps an earlier overflow there)."""
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.autocast("cpu", dtype=dtype):
        loss = loss_fn(model, batch)
    if not bool(torch.isfinite(loss).all()):
        return True
    grads = torch.autograd.grad(loss.float(), params, allow_unused=True)
    held = [g if p.grad is None else (p.grad if g is None else g + p.grad) for p, g in zip(params, grads)]
    return not all(g is None or bool(torch.isfinite(g).all()) for g in held)


@dataclass
class Result:
    case: Case
    diagnosis: Diagnosis
    hf_first: str | None
    min_scale: bool

    @property
    def cause_ok(self) -> bool:
        return self.diagnosis.cause == self.case.cause

    @property
    def module_ok(self) -> bool | None:
        return None if self.case.module is None else self.diagnosis.first_module == self.case.module

    @property
    def hf_ok(self) -> bool | None:
        return None if self.case.module is None else self.hf_first == self.case.module


def run_case(case: Case, compare_strategies: bool = False) -> Result:
    model, loss_fn, batch, kw = case.build()
    diagnosis = diagnose(model, loss_fn, batch, compare_strategies=compare_strategies, **kw)
    grads = [p.grad for p in model.parameters()]
    precision = kw.get("precision", "fp16")
    hf = hf_forward_hook_first(model, loss_fn, batch, precision)
    line = min_scale_line(model, loss_fn, batch, precision)
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    return Result(case, diagnosis, hf, line)


def evaluate(seeds: tuple[int, ...] = SEEDS) -> list[Result]:
    return [run_case(c) for c in cases(seeds)]


def _pct(hits: list[bool]) -> str:
    return "—" if not hits else f"{100 * sum(hits) / len(hits):.0f}% ({sum(hits)}/{len(hits)})"


def table(results: list[Result]) -> str:
    """The accuracy table, per cause and overall (Markdown)."""
    rows = ["| cause | cases | right cause | right first module | HF forward hook: right module | "
            "GradScaler says | \"minimum loss scale\" line fires |",
            "|---|---|---|---|---|---|---|"]
    for cause in CAUSES:
        rs = [r for r in results if r.case.cause == cause]
        if not rs:
            continue
        mods = [r.module_ok for r in rs if r.module_ok is not None]
        hfs = [r.hf_ok for r in rs if r.hf_ok is not None]
        rows.append(f"| {cause} | {len(rs)} | {_pct([r.cause_ok for r in rs])} | {_pct(mods)} | {_pct(hfs)} | "
                    f"nothing | {_pct([r.min_scale for r in rs])} |")
    mods = [r.module_ok for r in results if r.module_ok is not None]
    hfs = [r.hf_ok for r in results if r.hf_ok is not None]
    rows.append(f"| **all** | {len(results)} | {_pct([r.cause_ok for r in results])} | {_pct(mods)} | {_pct(hfs)} | "
                f"nothing | {_pct([r.min_scale for r in results])} |")
    return "\n".join(rows)


def accuracy(results: list[Result]) -> tuple[float, float]:
    """(right cause fraction, right first module fraction over cases that define one)."""
    mods = [r.module_ok for r in results if r.module_ok is not None]
    return sum(r.cause_ok for r in results) / len(results), sum(mods) / max(len(mods), 1)


def misses(results: list[Result]) -> list[str]:
    return [f"{r.case.name}: expected {r.case.cause}/{r.case.module}, got {r.diagnosis.cause}/{r.diagnosis.first_module}"
            for r in results if not r.cause_ok or r.module_ok is False]


GRADSCALER_SAYS = "nothing: the step is skipped and the scale halved, silently"
MIN_SCALE_LINE = '"Current loss scale already at minimum" / "Minimum loss scale reached", no cause'


def side_by_side(results: list[Result]) -> str:
    """One representative case per cause: what each tool would have told the user (Markdown)."""
    rows = ["| case | scalelab-doctor | GradScaler | DeepSpeed / fairseq / Megatron | HF DebugUnderflowOverflow-style hook |",
            "|---|---|---|---|---|"]
    for cause in CAUSES:
        r = next((r for r in results if r.case.cause == cause), None)
        if r is None:
            continue
        d = r.diagnosis
        where = f" at `{d.first_module}`" if d.first_module else ""
        doctor = f"**{d.cause}**{where}: {d.fix}"
        overflow = not (d.cause in ("healthy", "underflow", "grads_not_cleared"))
        scaler = GRADSCALER_SAYS if overflow else "nothing"
        ds = MIN_SCALE_LINE if r.min_scale else ("nothing (the scale backs off and recovers)" if overflow else "nothing")
        hf = f"first inf/nan output: `{r.hf_first}`" if r.hf_first else "nothing (no inf/nan in the forward)"
        rows.append(f"| `{r.case.name}` | {doctor.replace('|', '/')} | {scaler} | {ds} | {hf} |")
    return "\n".join(rows)


USAGE = """# scalelab-doctor: why the loss scale collapses, and what would fix it

<!-- Generated by `make doctor-eval` (experiments/doctor/evaluate.py); do not edit by hand. -->

```
scalelab-doctor RUN_DIR            # text verdict
scalelab-doctor RUN_DIR --json     # for tools
```

```python
from strategies.doctor import diagnose
d = diagnose(model, lambda m, b: loss(m(b[0]), b[1]), batch, precision="fp16", scaler=scaler)
print(d.text()); d.exit_code
```

The doctor re-runs one step of the model on one batch: a mixed forward under autocast with
forward hooks (which see positional and keyword arguments alike: HF models pass every input by
keyword) and a backward at the current scale with full backward hooks (and, when that
overflows, a backward at S = 1 through the same graph), and an fp32 forward and backward as the
reference. It names the first module whose output (forward) or input gradient (backward) leaves
the format's range, with the value the fp32 pass gives there (a forward culprit is re-run in
fp32 with its own arguments, a key-value cache left out), the per-layer underflow damage
(lost nonzero entries, cosine against fp32) at the current scale and at the scale each
registered strategy would choose, and the cause, from this decision list (first match wins):
"""
"""The page's head: the commands, the API and the method, up to the decision list."""

APP = """## Failure workloads (training app)

| workload | option | source |
|---|---|---|
| T5-style FFN forward overflow | `model=gpt_ffn_overflow` | HF transformers #9295 (T5 fp16 NaN; `wo` kept in fp32) |
| attention-logit growth, and its fix | `model=gpt_logit_growth optimizer.lr=0.3 optimizer.weight_decay=0 train.grad_clip=0` (see its YAML), then `model.qk_norm=true` | Wortsman et al. 2023 |
| NaN batch | `regime=nan_batch data=vectors model=mlp` (`data.nan_prob`) | broken data pipelines behind "Minimum loss scale reached" reports |
| fp16 policy gradient, small advantages | `regime=small_advantage`; the REINFORCE toy in this suite | fp16 RL fine-tuning |
| gradients not cleared | `train.zero_grad=false` (`experiments.app.build.keep_gradients`: `zero_grad()` a no-op); `+experiment=doctor_grads_not_cleared model=mlp data=vectors` starts the scaler above the safe scale, so the first overflow stays in `.grad` and the run stalls (the doctor: `grads_not_cleared`) | the missing `zero_grad()` loop bug; the "Current loss scale already at minimum" reports |
| loss spike at the learning-rate peak | `+experiment=doctor_lr_spike` (warmup of 8 steps to lr 3.0, no clipping): skips on the way up, diverges at the peak (the doctor: `lr_spike`) | Wortsman et al. 2023; OPT-175B logbook; PaLM (Chowdhery et al. 2022) Sec. 5.1 |
| fp8 where per-tensor casting matters | `+experiment=doctor_fp8_cast precision.cast_scaling=none` vs `=current` (fp8-E4M3 GPT, no loss scale): without cast scaling most activation-gradient entries round to zero | Micikevicius et al. 2022 (FP8 formats); TransformerEngine recipes |

Each is tested in a real short run (`tests/doctor/test_loop_bugs.py`, `test_lr_peak.py`,
`test_fp8_cast.py`, `test_cli.py`). The comparisons train real fp16 policy gradients instead of
the `small_advantage` stand-in: the `rl` workload (`conf/workload/rl.yaml`, GRPO on a pretrained
policy) is a regime of `make compare` and one of the court's two workloads (issue 30). The others
are separate experiment configs: they fail (or, for fp8, lose the gradient) by design for every
loss-scaling strategy, or need optimizer settings a regime cannot set, so as `compare` cells they
would add stalled or diverged runs to the ranking rather than a comparison of strategies.

## Automatic use

`experiments.doctor.diagnosis.diagnose_run(...)`, called by the training loop once a run ends, writes
`diagnosis.json` (the fields of `--json`, plus `status` and `step`) when the run stalled
(`train.max_consecutive_skips`), diverged, or a strategy stopped at its floor
(`on_min_scale: raise`); it never raises. `diagnosis.annotate(status, error, diag)` appends the
verdict's one line (`...; doctor: <cause> at <module>: <verdict>; fix: <fix>`) to the run's stop
message in `summary.json`'s `error`, whose `diagnosis` key holds the cause. `scalelab-report` shows
every diagnosed run in its **Diagnoses** table (run, status, cause, first module, verdict, fix) and
in `runs.csv` (`diagnosis`, `diagnosis_module`, `diagnosis_verdict`, `diagnosis_fix`,
`diagnosis_error`); a bad `diagnosis.json` is a listed bad record (docs/report.md).

## Limits

* The first module is found among `nn.Module`s: an overflow inside a module's own functional
  code is blamed on that module (e.g. a fused attention call on its block).
* `grads_not_cleared` needs the `.grad` the step started with: the API sees it, a run directory
  does not (checkpoints hold no gradients).
* `lr_spike` needs the learning-rate history (`lr_history`; the CLI passes the configured schedule).
  A scale-independent overflow at the peak of a fast rise (the rate at least doubled within the
  last 20 steps) is blamed on the rate: an overflow that the initial weights already cause, seen
  first at step 3 or later of a warmup, would be too (the loop stops such a run at step 2, where two
  rates are never a spike).
* A strategy's floor error is raised inside `step()`, before the loop clears `.grad`: the failing
  step's own gradients are set aside for the doctor, so accumulated gradients of a
  `train.zero_grad=false` run that also stops at its floor are not seen (a stalled one's are).
* The suite's faults are planted by construction (scaled weights, scaled losses, NaN entries);
  the decision list was written alongside it, so its accuracy is an upper bound for faults
  that look like these.
"""
"""The page's tail: the failure workloads of the training app, automatic use and limits."""


def exit_codes() -> str:
    """The exit-code table of ``scalelab-doctor`` (:data:`strategies.doctor.EXIT_CODES`), Markdown."""
    codes = "\n".join(f"| {c} | {EXIT_CODES[c]} |" for c in CAUSES)
    return f"""## Exit codes

| cause | exit code |
|---|---|
{codes}
| bad run directory or command line | 2 |
"""


def accuracy_section(text: str, results: list[Result]) -> str:
    """The measured accuracy: what it is worth, how it was measured, and the table ``text``."""
    cause_acc, module_acc = accuracy(results)
    return f"""## Accuracy on the labelled fault suite

**Read these numbers as an upper bound, not as an independent benchmark.** Every fault in the
suite is planted by construction (scaled weights, scaled or summed losses, NaN entries, gradients
left in `.grad`, a jump in the learning-rate history), and the decision list was written alongside
the suite by the same hands, so the doctor is scored on faults that look exactly like the ones it
was built to recognise. Faults in the wild are messier (several at once, a cause outside the list);
no held-out set of real failures has been measured.

{len(results)} cases ({len(SEEDS)} seeds, two or more sizes per fault; `experiments/doctor/cases.py`
says where each fault comes from). Right cause **{100 * cause_acc:.1f}%** (target 90%), right first
module **{100 * module_acc:.1f}%** (target 80%, over the cases whose first module is defined by
construction). "HF forward hook" is a forward-hook detector in the style of HF's
`DebugUnderflowOverflow` (first module whose output holds inf/nan), run on the same cases; the
"minimum loss scale" column is the share of cases where DeepSpeed's, fairseq's or Megatron's
minimum-scale line would fire (the step still overflows at their minimum scale 1) — it never
says why.

{text}
"""


def page(text: str, results: list[Result]) -> str:
    """``docs/doctor.md``: usage and method, the decision list (rendered from
    :data:`strategies.doctor.decide.DECISIONS`), exit codes, the measured tables, the app's side."""
    return "\n".join([USAGE, decision_list(), "", exit_codes(), accuracy_section(text, results),
                      f"## Side by side: what each tool tells the user\n\n{side_by_side(results)}\n", APP])


def write_docs(path: Path, text: str, results: list[Result]) -> None:
    """Write ``docs/doctor.md`` (:func:`page`)."""
    write_text_atomic(path, page(text, results))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="doctor-eval", description="Run the doctor's labelled fault suite.")
    parser.add_argument("--docs", type=Path, default=DOCS, help="write the table into this Markdown file")
    parser.add_argument("--no-docs", action="store_true", help="print only")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = evaluate()
    text = table(results)
    cause_acc, module_acc = accuracy(results)
    print(text)
    print(f"\nright cause {100 * cause_acc:.1f}% (target >= 90%), right first module {100 * module_acc:.1f}% (target >= 80%)")
    for line in misses(results):
        print(f"  miss: {line}")
    if not args.no_docs:
        write_docs(args.docs, text, results)
        print(f"wrote {args.docs}")
    return 0 if cause_acc >= 0.9 and module_acc >= 0.8 else 1


if __name__ == "__main__":
    sys.exit(main())
