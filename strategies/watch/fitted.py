"""The early-warning model's coefficients, written by ``make warning-eval``
(``experiments/warning/evaluate.py``; ``docs/early-warning.md``). Do not edit."""

__all__ = ["MODEL"]

MODEL = {
    "features": [
        "skip_rate",
        "scale_drop",
        "amax_growth",
        "loss_rise",
        "act_fill",
        "act_growth"
    ],
    "mean": [
        0.0056874381800197825,
        0.14302346544250605,
        0.5391839715308111,
        0.1551208266885655,
        0.12738052182341533,
        6.357082273242096
    ],
    "scale": [
        0.0252534656212857,
        0.4113553928025939,
        0.6246693512838162,
        0.3108862052146845,
        0.2437570584869823,
        4.552699357992814
    ],
    "coef": [
        0.18841743236571062,
        0.1555173059925324,
        0.0,
        1.822375188381613,
        2.600381753639339,
        2.679744656657751
    ],
    "intercept": -1.962036284477745,
    "threshold": 0.870063438388146
}
