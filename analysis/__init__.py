"""scalelab analysis: run records → tidy tables → interval estimates → figures → report.

* :mod:`analysis.load`       — read sweep directories into tidy DataFrames
  (:mod:`analysis.runset` builds them, every value coerced through :mod:`experiments.schema`);
* :mod:`analysis.wandb_runs` — the same tables from a W&B group;
* :mod:`analysis.stats`      — bootstrap intervals (scipy), unpaired tests, P(improvement);
* :mod:`analysis.paired`     — paired-by-seed statistics and the reading rule;
* :mod:`analysis.tables`     — per-strategy summaries, comparisons against ``native`` and fp32,
  tiered ranking;
* :mod:`analysis.verdict`    — the verdict in words; :mod:`analysis.text` — number formatting
  and the one place untrusted strings enter report text;
* :mod:`analysis.figures`    — the report's figures (matplotlib/seaborn, no pyplot state);
* :mod:`analysis.bench`      — read ``scalelab-bench`` JSON;
* :mod:`analysis.report`     — ``scalelab-report`` (Markdown + self-contained HTML + CSV);
  :mod:`analysis.document` renders one document model as both;
* ``analysis/notebooks/compare.py`` (+ ``.ipynb``) — the same analysis, interactively.

Never imports torch or the training code: of ``experiments`` only ``experiments.schema``
(``tests/analysis/test_hostile.py`` checks it).
"""
