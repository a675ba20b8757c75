"""scalelab analysis: run records → tidy tables → interval estimates → figures → report.

* :mod:`analysis.load`       — read sweep directories into tidy DataFrames
  (:mod:`analysis.runset` builds them from the values :mod:`analysis.records` reads, every one
  coerced through :mod:`experiments.schema`);
* :mod:`analysis.wandb_runs` — the same tables from a W&B group;
* :mod:`analysis.metrics`    — the metrics compared, each label, unit and noun defined once;
  :mod:`analysis.words` — every verdict word, defined once;
* :mod:`analysis.stats`      — bootstrap intervals (scipy), unpaired tests, P(improvement),
  Clopper–Pearson;
* :mod:`analysis.paired`     — paired-by-seed statistics and the reading rule;
* :mod:`analysis.tables`     — per-strategy summaries, comparisons against ``native`` and fp32,
  tiered ranking; :mod:`analysis.targets` (time to target), :mod:`analysis.profiles` and
  :mod:`analysis.when` (which strategy when, across workloads);
* :mod:`analysis.verdict`    — the verdict in words; :mod:`analysis.text` — number formatting
  and the one place untrusted strings enter report text;
* :mod:`analysis.figures`    — the report's figures (matplotlib/seaborn, no pyplot state);
* :mod:`analysis.bench`      — read ``scalelab-bench`` JSON;
* :mod:`analysis.report`     — ``scalelab-report`` (Markdown + self-contained HTML + CSV), its
  sections in :mod:`analysis.sections`, the short page ``docs/findings.md`` in
  :mod:`analysis.findings`; :mod:`analysis.document` renders one document model as both and
  writes every generated page (:func:`analysis.document.write_document`);
* :mod:`analysis.reproduce`  — ``scalelab-reproduce``: published claims re-tested, and their page;
* ``analysis/notebooks/compare.py`` (+ ``.ipynb``) — the same analysis, interactively.

Never imports torch or the training code: of ``experiments`` only ``experiments.schema``
(``tests/analysis/test_hostile.py`` checks it).
"""

__all__: list[str] = []
