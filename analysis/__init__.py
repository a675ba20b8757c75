"""scalelab analysis: run records → tidy tables → interval estimates → figures → report.

* :mod:`analysis.load`     — read sweep directories (or a W&B group) into tidy DataFrames;
* :mod:`analysis.stats`    — bootstrap intervals, comparisons against ``native``, tiered ranking;
* :mod:`analysis.figures`  — the report's figures (matplotlib/seaborn, no pyplot state);
* :mod:`analysis.bench`    — read ``scalelab-bench`` JSON;
* :mod:`analysis.report`   — ``scalelab-report`` (Markdown + self-contained HTML + CSV);
* ``analysis/notebooks/compare.py`` (+ ``.ipynb``) — the same analysis, interactively.

Never imports the training code (``experiments``, ``strategies``).
"""
