"""The early warning: the detector (:mod:`strategies.watch.detector`) over the telemetry a loop
already has, with the coefficients ``make warning-eval`` fitted (:mod:`strategies.watch.fitted`)."""

from __future__ import annotations

from strategies.watch.detector import Detector, Observation, observations

__all__ = ["Detector", "Observation", "observations"]
