"""The TensorRT backend's stream ordering: needs a CUDA GPU (torch streams), not TensorRT."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch CUDA streams)")]


def test_tensorrts_stream_waits_for_the_work_torch_queued():
    """Issue 17, item 9: TrtBackend.forward casts the step's inputs on torch's current stream and TensorRT runs
    execute_async_v3 on its own stream (IExecutionContext::enqueueV3 is asynchronous on the stream it is given,
    NVIDIA/TensorRT include/NvInferRuntime.h). Nothing ordered the two, so TensorRT could read the inputs before
    they were written. wait_for_torch, which forward calls before execute_async_v3, must hold TensorRT's stream
    until torch's current stream has done everything queued so far."""
    from kvedge.tensorrt.backend import wait_for_torch

    tensorrts = torch.cuda.Stream()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock on torch's current stream: slow input casts
    wait_for_torch(tensorrts.cuda_stream)
    after = torch.cuda.Event()
    after.record(tensorrts)  # where execute_async_v3's work would start
    assert not after.query(), "TensorRT's stream went ahead of the work queued on torch's stream"
    torch.cuda.synchronize()
    assert after.query()
