"""The early-warning model's coefficients (placeholder until ``make warning-eval`` writes them)."""

__all__ = ["MODEL"]

MODEL = {"features": ["skip_rate", "scale_drop", "amax_growth", "loss_rise"], "mean": [0.0, 0.0, 0.0, 0.0],
         "scale": [1.0, 1.0, 1.0, 1.0], "coef": [1.0, 1.0, 1.0, 1.0], "intercept": -4.0, "threshold": 0.5}
