"""Export: torch Decoder -> ONNX with the KV cache as explicit inputs/outputs, one lowering per target.

The graph's contract and its sidecar are kvedge.artifact's; export writes them, the runtime and
kvedge.tensorrt read them. Export may use the runtime (to verify); nothing below it imports export.
"""

from kvedge.export.exporter import export, to_onnx
from kvedge.export.lowerings import LOWERINGS
from kvedge.export.prepare import ExportOptions

__all__ = ["LOWERINGS", "ExportOptions", "export", "to_onnx"]
