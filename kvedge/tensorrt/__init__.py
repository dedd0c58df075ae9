"""TensorRT: version gating, optimization profiles and the buffer plan (pure Python, tested in CI), the
`kvedge check` pre-flight, and the thin layers that call TensorRT: `kvedge build`, the kvedge plugin's
registration and the runtime backend. Importing this package imports no TensorRT; each call that needs
it imports it then, with a one-line error where it is missing.

Depends on kvedge.artifact, kvedge.models, kvedge.runtime (the Backend protocol) and kvedge.kernels;
never on kvedge.export (docs/design.md).
"""
