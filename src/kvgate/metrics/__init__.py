"""Prometheus metrics and kvgate's HTTP endpoint."""

from kvgate.metrics.definitions import Metrics

__all__ = ["Metrics"]
