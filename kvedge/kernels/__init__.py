"""Fused attention kernels (Triton). Imported only where triton is installed; see triton_attention."""
