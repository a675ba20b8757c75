# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Compare loss-scaling strategies
#
# Interactive companion of `scalelab-report`: loads one sweep (local run directories, or a W&B
# group), then shows the run statuses, the per-strategy interval estimates, each strategy
# against `native`, the tiered ranking, which strategy when, and the figures. Every number
# comes from `analysis.load` / `analysis.tables` / `analysis.when` / `analysis.figures`, the
# same code as the report.
#
# **Choose the runs** in the next cell, or without editing anything through environment
# variables: `SCALELAB_RUN_DIR` (one or more sweep directories separated by `:`) or
# `SCALELAB_WANDB` (`entity/project/group`, needs network access and a W&B login).
# Keep this notebook in sync with its `.py` twin: `jupytext --sync analysis/notebooks/compare.py`.

# %% tags=["parameters"]
import os

RUN_DIR = os.environ.get("SCALELAB_RUN_DIR", "runs/compare")
WANDB = os.environ.get("SCALELAB_WANDB", "")  # "entity/project/group" to read from W&B instead
N_BOOT = int(os.environ.get("SCALELAB_N_BOOT", "2000"))

# %%
import sys
from pathlib import Path

import pandas as pd
from IPython.display import Image, Markdown, display

try:
    import analysis  # noqa: F401  # installed (pip install -e .) or run from the repo root
except ImportError:  # opened from analysis/notebooks/ without installing: use the checkout
    sys.path.insert(0, str(Path.cwd().resolve().parents[1]))

from analysis import figures as F
from analysis.load import load_runs, load_wandb
from analysis.metrics import PRIMARY
from analysis.tables import compare_to_baseline, compare_to_reference, rank_strategies, summarize
from analysis.when import order_text, which_strategy_when

pd.set_option("display.width", 200)
pd.set_option("display.max_columns", 30)

if WANDB:
    entity, project, group = WANDB.split("/", 2)
    rs = load_wandb(f"{entity}/{project}", group=group)
else:
    rs = load_runs([p for p in RUN_DIR.split(":") if p])
print(f"{len(rs.runs)} runs from {rs.sources}")
rs.runs["status"].value_counts()

# %% [markdown]
# ## Run status
# Every run is kept: `failed` (an exception), `diverged` (non-finite or exploding loss) and
# `incomplete` (no summary, or still `running`) runs are listed here and excluded from the
# statistics below. Corrupt `metrics.jsonl` lines were skipped and are listed as problems.

# %%
display(rs.runs[["run_id", "workload", "precision", "strategy", "seed", "status", "steps",
                 "final_eval_loss", "error"]])
for problem in rs.problems:
    print("problem:", problem)

# %% [markdown]
# ## Interval estimates over seeds
# Mean and interquartile mean with 95 % BCa bootstrap intervals (scipy, fixed RNG seed). With 3
# seeds these intervals are narrow by construction and cover the truth only about 7 times in 10.

# %%
summary = summarize(rs.runs, n_boot=N_BOOT)
cols = ["workload", "precision", "strategy", "n_completed", "n_diverged", "n_failed",
        f"{PRIMARY}_mean", f"{PRIMARY}_mean_lo", f"{PRIMARY}_mean_hi", f"{PRIMARY}_iqm",
        "skipped_steps_mean", "strategy_overhead_frac_mean", "act_zero_frac_mean_mean"]
summary[cols]

# %% [markdown]
# ## Ranking (ties where intervals overlap) and each strategy against `native` and fp32
# Paired by seed: `paired_diff` is the mean per-seed difference (negative is better) with its
# bootstrap interval, `p_better` the fraction of seeds where the strategy is lower, and
# `reading` the report's words (rule: README, "Read the report"). A diverged run loses its seed.

# %%
ranks = rank_strategies(summary)
display(ranks)
comps = pd.concat([compare_to_baseline(rs.runs, n_boot=N_BOOT),
                   compare_to_reference(rs.runs, n_boot=N_BOOT)], ignore_index=True)
if not comps.empty:
    display(comps[comps["metric"] == PRIMARY][["workload", "precision", "strategy", "baseline",
                                               "n_pairs", "paired_diff", "paired_diff_lo",
                                               "paired_diff_hi", "p_better", "paired_t_p_holm",
                                               "wilcoxon_p", "reading"]])

# %% [markdown]
# ## Which strategy when
# Per regime × precision: the best strategy (clearly better than `native` on the earliest metric
# of the verdict's order for which any strategy is), its paired effect against `native` and its
# final-eval-loss gap to the fp32 run of the same seed, and why. Cells without `native` (bf16
# controls) are compared with fp32 only; `steps_to_target` is in `rs.runs`.

# %%
print("metric order:", order_text())
display(which_strategy_when(rs.runs, comps))

# %% [markdown]
# ## Figures
# Loss curves against the fp32 reference, final-metric intervals, paired differences, gradient
# fidelity over steps (when probes were logged), scale trajectories, skipped steps, the
# per-layer underflow heat map and the gradient-exponent histogram against the format's range.

# %%
figs = F.all_figures(rs, summary)
for f in figs:
    display(Markdown(f"### {f.title}\n{f.caption}"))
    display(Image(data=F.figure_png(f.fig, dpi=80)))
F.close_all(figs)
print(f"{len(figs)} figures")
