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
        0.0073497854077253216,
        0.171910881513775,
        0.41937307740640173,
        0.052079594705172774
    ],
    "scale": [
        0.02543144908020373,
        0.3730713121057076,
        0.5591628415962377,
        0.2317205386491727
    ],
    "coef": [
        0.06032875763538956,
        0.0,
        0.23146055441235636,
        2.6799494202713428
    ],
    "intercept": 0.1539690600208377,
    "threshold": 0.652318793644019
}
