"""Proving artifacts: parity against PyTorch, latency and memory reports, memory planning."""

from kvedge.bench.parity import ParityReport, compare
from kvedge.bench.plan import DEVICES, Plan, parameter_count, plan

__all__ = ["DEVICES", "ParityReport", "Plan", "compare", "parameter_count", "plan"]
