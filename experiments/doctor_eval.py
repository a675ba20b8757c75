"""The doctor's labelled fault suite and its accuracy table (``make doctor-eval``).

Each :class:`Case` builds a small model, a loss and a batch in which one known fault is planted,
and labels it with the cause (``strategies.doctor.CAUSES``) and, where one is defined by
construction, the first module that leaves the format's range. The faults and where they come
from:

* ``forward_overflow`` — a GPT whose FFN weights start ``ffn_gain`` times larger, so that
  ``blocks.0.fc_out`` outputs more than 65504 (T5's ``wo``, HF transformers #9295); a GPT whose
  attention logits have grown (``attention="explicit"``, q/k weights scaled: Wortsman et al.
  2023), first module ``blocks.0.scores``; an MLP whose hidden layer ``k`` outputs too much.
* ``nan_in_data_or_loss`` — a NaN entry in the batch (a broken data pipeline), or a loss that is
  non-finite in fp32 (``log(0)``).
* ``grads_not_cleared`` — the step runs on a model whose ``.grad`` holds ``k`` earlier steps'
  gradients (the missing ``optimizer.zero_grad()`` loop bug).
* ``lr_spike`` — one SGD step at a learning rate 1000x the schedule's, then the doctor, given
  the learning-rate history.
* ``gradient_overflow`` — a sum-reduced loss (``reduction="sum"`` over many tokens) whose
  gradient exceeds fp16's range at S = 1: first module ``head``.
* ``scale_overflow`` — a loss 100x larger than the default scale allows: overflow at 2^16 only.
* ``underflow`` — the fp16 policy-gradient toy: REINFORCE's ``-A log pi(a|s)`` with advantages
  ``|A| ~ 1e-7`` (Micikevicius et al. 2018's small-gradient case, as in fp16 RL fine-tuning).
* ``healthy`` — the same models with nothing planted, and the FFN-overflow GPT in bf16 (the
  control: bf16's range holds the T5-style output, so the doctor must not cry wolf).

Baselines, computed on the same cases: ``torch.amp.GradScaler`` (skips the step and halves the
scale: it tells the user nothing); DeepSpeed / fairseq / Megatron (their "Current loss scale
already at minimum" / "Minimum loss scale reached" line fires when the same step still
overflows at their minimum scale 1, i.e. when the mixed gradient is non-finite at S = 1: we run
that step); HF's ``DebugUnderflowOverflow`` (forward hooks; reports the first module whose
output has inf/nan: :func:`hf_forward_hook_first`, run for real).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from experiments.models import GPT, MLP
from strategies import doctor as doctor_module
from strategies.doctor import CAUSES, EXIT_CODES, Diagnosis, diagnose

__all__ = ["Case", "cases", "evaluate", "hf_forward_hook_first", "min_scale_line", "main"]

SEEDS = (0, 1, 2)
DOCS = Path(__file__).resolve().parent.parent / "docs" / "doctor.md"


@dataclass
class Case:
    """One labelled fault: ``build()`` returns ``(model, loss_fn, batch, diagnose keywords)``."""

    name: str
    cause: str
    module: str | None
    build: Callable[[], tuple[torch.nn.Module, Callable, Any, dict]]


def _ce(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    logits = model(batch[0])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[1].reshape(-1))


def _mlp(seed: int, width: int, depth: int = 3, n: int = 64) -> tuple[MLP, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    model = MLP(in_features=32, num_classes=10, width=width, depth=depth)
    g = torch.Generator().manual_seed(1000 + seed)
    return model, (torch.randn(n, 32, generator=g), torch.randint(10, (n,), generator=g))


def _gpt(seed: int, n_embd: int, **kw: Any) -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    model = GPT(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=n_embd, **kw)
    g = torch.Generator().manual_seed(1000 + seed)
    return model, (torch.randint(64, (4, 32), generator=g), torch.randint(64, (4, 32), generator=g))


def _with_ce(model_batch: tuple[torch.nn.Module, Any]) -> tuple[torch.nn.Module, Callable, Any, dict]:
    return model_batch[0], _ce, model_batch[1], {}


def _scaled(loss_fn: Callable, factor: float) -> Callable:
    return lambda model, batch: loss_fn(model, batch) * factor


def _forward_cases(seed: int) -> list[Case]:
    def logits(n: int) -> Callable:
        def build() -> tuple:
            model, batch = _gpt(seed, n, attention="explicit")
            with torch.no_grad():
                for block in model.blocks:
                    block.qkv.weight[: 2 * n].mul_(2000.0 / math.sqrt(n / 32))  # q and k rows only
            return _with_ce((model, batch))
        return build

    def hidden(width: int, k: int) -> Callable:
        def build() -> tuple:
            model, batch = _mlp(seed, width)
            with torch.no_grad():
                model.layers[k][0].weight.mul_(1e6)
            return _with_ce((model, batch))
        return build

    out = [Case(f"ffn_overflow/gpt{n}/s{seed}", "forward_overflow", "blocks.0.fc_out",
                lambda n=n: _with_ce(_gpt(seed, n, ffn_gain=1500.0))) for n in (32, 64)]
    out += [Case(f"logit_growth/gpt{n}/s{seed}", "forward_overflow", "blocks.0.scores", logits(n)) for n in (32, 64)]
    out += [Case(f"hidden_overflow/mlp{w}/l{k}/s{seed}", "forward_overflow", f"layers.{k}.0", hidden(w, k))
            for w, k in ((32, 1), (64, 2))]
    return out


def _nan_cases(seed: int) -> list[Case]:
    def data(width: int) -> Callable:
        def build() -> tuple:
            model, (x, y) = _mlp(seed, width)
            x = x.clone()
            x[seed % len(x), (7 * seed) % x.shape[1]] = float("nan")
            return model, _ce, (x, y), {}
        return build

    def log_zero(width: int) -> Callable:
        def build() -> tuple:
            model, batch = _mlp(seed, width)
            return model, (lambda m, b: _ce(m, b) + torch.log(torch.zeros(()))), batch, {}
        return build

    return ([Case(f"nan_batch/mlp{w}/s{seed}", "nan_in_data_or_loss", None, data(w)) for w in (32, 64)]
            + [Case(f"log_zero_loss/mlp{w}/s{seed}", "nan_in_data_or_loss", None, log_zero(w)) for w in (32, 64)])


def _accumulated_cases(seed: int) -> list[Case]:
    def build_for(width: int, k: int) -> Callable:
        def build() -> tuple:
            model, batch = _mlp(seed, width)
            for _ in range(k):  # the loop bug: backward every step, zero_grad never
                _ce(model, batch).backward()
            return model, _ce, batch, {}
        return build

    def gpt(k: int) -> Callable:
        def build() -> tuple:
            model, batch = _gpt(seed, 32)
            for _ in range(k):
                _ce(model, batch).backward()
            return model, _ce, batch, {}
        return build

    return ([Case(f"grads_not_cleared/mlp{w}/k{k}/s{seed}", "grads_not_cleared", None, build_for(w, k))
             for w, k in ((32, 4), (64, 10))]
            + [Case(f"grads_not_cleared/gpt32/k4/s{seed}", "grads_not_cleared", None, gpt(4))])


def _lr_spike_cases(seed: int) -> list[Case]:
    def build_for(width: int) -> Callable:
        def build() -> tuple:
            model, batch = _mlp(seed, width)
            history = [1e-3] * 20
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            for lr in history + [1e-3 * 3e5]:  # the spike: a schedule bug multiplies the peak
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.zero_grad()
                _ce(model, batch).backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
            return model, _ce, batch, {"lr_history": history + [1e-3 * 3e5]}
        return build

    return [Case(f"lr_spike/mlp{w}/s{seed}", "lr_spike", None, build_for(w)) for w in (32, 64)]


def _gradient_cases(seed: int) -> list[Case]:
    def summed(width: int, n: int) -> Callable:
        def build() -> tuple:
            model, batch = _mlp(seed, width, n=n)
            loss = lambda m, b: F.cross_entropy(m(b[0]).float(), b[1], reduction="sum") * 1e5
            return model, loss, batch, {}
        return build

    def summed_gpt() -> Callable:
        def build() -> tuple:
            model, batch = _gpt(seed, 32)
            loss = lambda m, b: F.cross_entropy(m(b[0]).float().reshape(-1, 64), b[1].reshape(-1), reduction="sum") * 1e5
            return model, loss, batch, {}
        return build

    def large(width: int) -> Callable:
        def build() -> tuple:
            model, batch = _mlp(seed, width)
            return model, _scaled(_ce, 100.0), batch, {}
        return build

    return ([Case(f"sum_loss/mlp{w}/n{n}/s{seed}", "gradient_overflow", "head", summed(w, n)) for w, n in ((32, 64), (64, 256))]
            + [Case(f"sum_loss/gpt32/s{seed}", "gradient_overflow", "head", summed_gpt())]
            + [Case(f"large_loss/mlp{w}/s{seed}", "scale_overflow", "head", large(w)) for w in (32, 64)])


def _underflow_cases(seed: int) -> list[Case]:
    def reinforce(width: int, adv: float) -> Callable:
        def build() -> tuple:
            model, (x, _) = _mlp(seed, width)
            g = torch.Generator().manual_seed(2000 + seed)
            with torch.no_grad():
                actions = torch.multinomial(model(x).softmax(-1), 1, generator=g).squeeze(1)
            advantages = adv * torch.randn(len(x), generator=g)

            def loss(m: torch.nn.Module, b: Any) -> torch.Tensor:
                logp = m(b[0]).float().log_softmax(-1).gather(1, b[1][:, None]).squeeze(1)
                return -(b[2] * logp).mean()
            return model, loss, (x, actions, advantages), {}
        return build

    def tiny_gpt() -> tuple:
        model, batch = _gpt(seed, 32)
        return model, _scaled(_ce, 1e-8), batch, {}  # the tiny_grad regime's loss multiplier

    return ([Case(f"pg_small_advantage/mlp{w}/A{a:g}/s{seed}", "underflow", None, reinforce(w, a))
             for w, a in ((32, 1e-7), (64, 3e-8))]
            + [Case(f"tiny_grad/gpt32/s{seed}", "underflow", None, tiny_gpt)])


def _healthy_cases(seed: int) -> list[Case]:
    return ([Case(f"plain/mlp{w}/s{seed}", "healthy", None, lambda w=w: _with_ce(_mlp(seed, w))) for w in (32, 64)]
            + [Case(f"plain/gpt32/s{seed}", "healthy", None, lambda: _with_ce(_gpt(seed, 32))),
               Case(f"bf16_control/ffn_overflow/gpt32/s{seed}", "healthy", None, lambda: (
                   *_with_ce(_gpt(seed, 32, ffn_gain=1500.0))[:3], {"precision": "bf16"}))])


def cases(seeds: tuple[int, ...] = SEEDS) -> list[Case]:
    """Every labelled case, for every seed."""
    out: list[Case] = []
    for seed in seeds:
        for make in (_forward_cases, _nan_cases, _accumulated_cases, _lr_spike_cases, _gradient_cases,
                     _underflow_cases, _healthy_cases):
            out += make(seed)
    return out


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
    the mixed gradient of this step at S = 1 is non-finite."""
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.autocast("cpu", dtype=dtype):
        loss = loss_fn(model, batch)
    if not bool(torch.isfinite(loss).all()):
        return True
    grads = torch.autograd.grad(loss.float(), params, allow_unused=True)
    return not all(g is None or bool(torch.isfinite(g).all()) for g in grads)


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


def write_docs(path: Path, text: str, results: list[Result]) -> None:
    """Write ``docs/doctor.md``: usage, the decision list, exit codes and the measured tables."""
    cause_acc, module_acc = accuracy(results)
    codes = "\n".join(f"| {c} | {EXIT_CODES[c]} |" for c in CAUSES)
    decision = doctor_module.__doc__.split("**Decision list**")[1].split("Sources:")[0].strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""# scalelab-doctor: why the loss scale collapses, and what would fix it

<!-- Generated by `make doctor-eval` (experiments/doctor_eval.py); do not edit by hand. -->

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
forward hooks and a backward at the current scale with full backward hooks (and, when that
overflows, a backward at S = 1 through the same graph), and an fp32 forward and backward as the
reference. It names the first module whose output (forward) or input gradient (backward) leaves
the format's range, with the value the fp32 pass gives there, the per-layer underflow damage
(lost nonzero entries, cosine against fp32) at the current scale and at the scale each
registered strategy would choose, and the cause, from this decision list (first match wins):

{decision}

## Exit codes

| cause | exit code |
|---|---|
{codes}
| bad run directory or command line | 2 |

## Accuracy on the labelled fault suite

{len(results)} cases ({len(SEEDS)} seeds, two or more sizes per fault; `experiments/doctor_eval.py`
says where each fault comes from). Right cause **{100 * cause_acc:.1f}%** (target 90%), right first
module **{100 * module_acc:.1f}%** (target 80%, over the cases whose first module is defined by
construction). "HF forward hook" is a forward-hook detector in the style of HF's
`DebugUnderflowOverflow` (first module whose output holds inf/nan), run on the same cases; the
"minimum loss scale" column is the share of cases where DeepSpeed's, fairseq's or Megatron's
minimum-scale line would fire (the step still overflows at their minimum scale 1) — it never
says why.

{text}

## Side by side: what each tool tells the user

{side_by_side(results)}

## Failure workloads (training app)

| workload | option | source |
|---|---|---|
| T5-style FFN forward overflow | `model=gpt_ffn_overflow` | HF transformers #9295 (T5 fp16 NaN; `wo` kept in fp32) |
| attention-logit growth, and its fix | `model=gpt_logit_growth optimizer.lr=0.3 optimizer.weight_decay=0 train.grad_clip=0` (see its YAML), then `model.qk_norm=true` | Wortsman et al. 2023 |
| NaN batch | `regime=nan_batch data=vectors model=mlp` (`data.nan_prob`) | broken data pipelines behind "Minimum loss scale reached" reports |
| fp16 policy gradient, small advantages | `regime=small_advantage`; the REINFORCE toy in this suite | fp16 RL fine-tuning |
| gradients not cleared | this suite only (the loop always clears) | the missing `zero_grad()` loop bug |

## Automatic use

`experiments.diagnosis.diagnose_run(...)`, called by the training loop once a run ends, writes
`diagnosis.json` (the fields of `--json`, plus `status` and `step`) when the run stalled
(`train.max_consecutive_skips`), diverged, or a strategy stopped at its floor
(`on_min_scale: raise`); it never raises.

## Limits

* The first module is found among `nn.Module`s: an overflow inside a module's own functional
  code is blamed on that module (e.g. a fused attention call on its block).
* `grads_not_cleared` needs the `.grad` the step started with: the API sees it, a run directory
  does not (checkpoints hold no gradients).
* `lr_spike` needs the learning-rate history (`lr_history`; the CLI passes the configured schedule).
* The suite's faults are planted by construction (scaled weights, scaled losses, NaN entries);
  the decision list was written alongside it, so its accuracy is an upper bound for faults
  that look like these.
""")


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
