"""Export: torch Decoder -> ONNX with the KV cache as explicit inputs/outputs, one lowering per target."""

from kvedge.export.contract import SIDECAR, Sidecar, input_names, output_names
from kvedge.export.exporter import ExportOptions, export, to_onnx
from kvedge.export.lowerings import LOWERINGS

__all__ = ["LOWERINGS", "SIDECAR", "ExportOptions", "Sidecar", "export", "input_names", "output_names", "to_onnx"]
