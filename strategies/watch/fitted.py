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
        0.00754928874469678,
        0.1563266247987133,
        0.49600087949137284,
        0.16245308082005103,
        0.12636311543745393,
        5.682436849674789
    ],
    "scale": [
        0.029513923621677256,
        0.3857364869845085,
        0.6413007369884483,
        0.3463083102303424,
        0.2306758869055488,
        4.562084732107269
    ],
    "coef": [
        0.16557192842825524,
        0.09342363302523701,
        0.0,
        2.4823898228553056,
        2.3834701954446866,
        2.6900125917299293
    ],
    "intercept": -1.7959558644771856,
    "threshold": 0.9094081197718095
}
