"""Running exported or reference models: generation over preallocated caches."""

from kvedge.runtime.greedy import GreedyResult, greedy

__all__ = ["GreedyResult", "greedy"]
