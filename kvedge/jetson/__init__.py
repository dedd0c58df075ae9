"""Jetson: device and version detection, power mode, tegrastats sampling, memory budget."""

from kvedge.jetson.device import JETPACK, JetsonInfo, detect, usable_memory_bytes
from kvedge.jetson.tegrastats import Sample, Sampler, parse_line, summarize

__all__ = ["JETPACK", "JetsonInfo", "Sample", "Sampler", "detect", "parse_line", "summarize", "usable_memory_bytes"]
