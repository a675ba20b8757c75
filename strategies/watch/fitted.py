"""The early-warning model's coefficients, written by ``make warning-eval``
(``experiments/warning/evaluate.py``; ``docs/early-warning.md``). Do not edit."""

__all__ = ["MODEL"]

MODEL = {
    "features": [
        "skip_rate",
        "scale_drop",
        "amax_growth",
        "loss_rise"
    ],
    "mean": [
        0.007683823529411765,
        0.15221464130687773,
        0.466435850107986,
        0.08296925779625619
    ],
    "scale": [
        0.02983199433864685,
        0.3780584722470136,
        0.65337227495918,
        0.2682304061238314
    ],
    "coef": [
        0.09961320086754506,
        0.0,
        0.8456399623391725,
        1.117686261292354
    ],
    "intercept": -0.11563278980986388,
    "threshold": 0.7612668948117954
}
