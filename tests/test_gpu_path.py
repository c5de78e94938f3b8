"""The GPU path without a GPU: what it reads from Paddle, and how the engine picks and proves its device.

Paddle facts are taken from the installed wheel itself where it ships the code
(the CPU wheel has the same Python classes as paddlepaddle-gpu 3.3.1):

* ``paddle.device.Stream`` (``paddle/device/__init__.py``): the raw handle is
  ``stream.stream_base.cuda_stream`` and ``__cuda_stream__() == (0,
  stream_base.raw_stream)``; the wrapper has no ``cuda_stream`` of its own.
  ``CUDAStream.cuda_stream`` and ``.raw_stream`` both return
  ``raw_stream()`` as an int (PaddlePaddle/Paddle
  ``paddle/fluid/pybind/cuda_streams_py.cc`` @ 000bd27f7e45b17297a90b4d5dd9c5bd1efa2f7c).
* ``Tensor.__cuda_array_interface__`` (``paddle/base/dygraph/tensor_patch_methods.py``),
  run here on a stand-in that reports a GPU place: bf16 and fp16 both ``<f2``,
  byte strides when not contiguous, ``RuntimeError`` when the tensor requires grad.
"""
import importlib.util
import logging
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

from engine import LLM
from engine import device as engine_device
from engine.config import EngineConfig, add_engine_args, config_from_args
from gpu_kernels import interop
from tiny_models import make_tiny_model, tiny_prompts

PADDLE_CAI = paddle.Tensor.__dict__["__cuda_array_interface__"].fget  # Paddle's own property


class PaddleGPUTensor:
    """A CPU Paddle tensor seen as if it lived on GPU ``device_id``: exactly the members Paddle's
    ``__cuda_array_interface__`` and our interop read, delegated to the real tensor."""

    def __init__(self, tensor, device_id=0):
        self.t, self.device_id = tensor, device_id
        self.stop_gradient = tensor.stop_gradient
        self.place = SimpleNamespace(is_gpu_place=lambda: True, gpu_device_id=lambda: device_id)

    dtype = property(lambda self: self.t.dtype)
    shape = property(lambda self: self.t.shape)
    strides = property(lambda self: self.t.strides)
    __cuda_array_interface__ = property(PADDLE_CAI)

    def is_sparse(self):
        return False

    def element_size(self):
        return self.t.element_size()

    def is_contiguous(self):
        return self.t.is_contiguous()

    def data_ptr(self):
        return self.t.data_ptr()

    def numel(self):
        return self.t.numel()

    def detach(self):
        return PaddleGPUTensor(self.t.detach(), self.device_id)


# ---------------------------------------------------------------- streams


def real_paddle_stream(handle):
    """A real ``paddle.device.Stream`` built without a GPU, its ``stream_base`` a stand-in for the
    pybind ``CUDAStream`` with the two handle properties it has on a CUDA build."""
    stream = object.__new__(paddle.device.Stream)
    stream.stream_base = SimpleNamespace(cuda_stream=handle, raw_stream=handle, place="gpu:1")
    stream.device = "gpu:1"
    return stream


def test_paddle_current_stream_handle_comes_through_the_stream_protocol(monkeypatch):
    stream = real_paddle_stream(0x7F00BEEF)
    with pytest.raises(AttributeError):
        stream.cuda_stream  # what the GPU path used to read: Paddle's Stream has no such attribute
    assert stream.__cuda_stream__() == (0, 0x7F00BEEF)
    asked = []
    monkeypatch.setattr(paddle.device, "current_stream", lambda device=None: asked.append(device) or stream)
    x = PaddleGPUTensor(paddle.zeros([2, 3]), device_id=1)
    assert interop._paddle_stream_handle(x) == 0x7F00BEEF
    assert asked == ["gpu:1"]  # the tensor's own GPU, by name (a tensor's place is not a CUDAPlace)


def test_stream_protocol_versions_and_host_arrays():
    class Future:
        def __cuda_stream__(self):
            return (1, 5)

    with pytest.raises(ValueError, match="version 1"):
        interop.stream_protocol_handle(Future())
    assert interop.stream_protocol_handle(object()) is None
    assert interop.framework_stream_handle(np.zeros(3)) == 0           # host memory: default stream
    assert interop.framework_stream_handle(paddle.zeros([3])) == 0     # a CPU Paddle tensor too


# ---------------------------------------------------------------- __cuda_array_interface__


def test_paddle_bf16_cuda_view_is_uint16_and_fp16_stays_half():
    base = paddle.arange(24, dtype="float32").reshape([2, 3, 4])
    bf16, fp16 = PaddleGPUTensor(base.astype("bfloat16")), PaddleGPUTensor(base.astype("float16"))
    assert bf16.__cuda_array_interface__["typestr"] == "<f2" == fp16.__cuda_array_interface__["typestr"]
    key_b, cai_b = interop._paddle_device_interface(bf16)
    key_h, cai_h = interop._paddle_device_interface(fp16)
    assert cai_b["typestr"] == "<u2" and cai_h["typestr"] == "<f2"
    assert cai_b["shape"] == (2, 3, 4) and cai_b["strides"] is None and cai_b["data"] == (bf16.t.data_ptr(), False)
    assert key_b != key_h


def test_paddle_strided_cuda_view_keeps_byte_strides():
    fused = paddle.arange(2 * 12, dtype="float32").reshape([2, 12])
    query = PaddleGPUTensor(fused[:, 4:8])  # a slice of a fused QKV row
    key, cai = interop._paddle_device_interface(query)
    assert cai["strides"] == (48, 4) and cai["shape"] == (2, 4)
    assert cai["data"][0] == fused[:, 4:8].data_ptr()
    contiguous_key, _ = interop._paddle_device_interface(PaddleGPUTensor(fused[:, 4:8].contiguous()))
    assert key != contiguous_key


def test_paddle_tensor_that_requires_grad_is_read_through_detach():
    t = paddle.ones([4, 8])
    t.stop_gradient = False
    x = PaddleGPUTensor(t)
    with pytest.raises(RuntimeError, match="requires grad"):
        x.__cuda_array_interface__
    _, cai = interop._paddle_device_interface(x)
    assert cai["data"][0] == t.data_ptr() and cai["typestr"] == "<f4"


def test_simulated_views_share_memory_in_the_device_representation():
    half = paddle.arange(6, dtype="float32").astype("float16")
    view = interop._simulated_view(half)
    assert view.dtype == np.float16
    view[0] = 7
    assert float(half[0]) == 7.0  # same memory
    strided = paddle.arange(12, dtype="float32").reshape([3, 4])[:, 1:3]
    np.testing.assert_array_equal(interop._simulated_view(strided), strided.numpy())


# ---------------------------------------------------------------- device and backend resolution


@pytest.fixture
def cuda_paddle_without_numba_cuda(monkeypatch):
    """Paddle built with CUDA and seeing a GPU, numba-cuda not installed."""
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(paddle.device.cuda, "device_count", lambda: 1)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "numba_cuda" else real(name, *a, **k))


def test_auto_falls_back_to_cpu_when_numba_cuda_is_missing(cuda_paddle_without_numba_cuda, caplog):
    with caplog.at_level(logging.INFO, logger="engine"):
        assert engine_device.resolve_device("auto") == "cpu"
    assert "numba-cuda is not installed" in caplog.text
    with pytest.raises(ValueError, match="device='gpu' cannot run here: numba-cuda is not installed"):
        engine_device.resolve_device("gpu")


def test_attention_backend_must_fit_the_device():
    assert engine_device.resolve_attention_backend("auto", "cpu") == ("cpu", None)
    assert engine_device.resolve_attention_backend("auto", "gpu") == ("cuda", None)
    assert engine_device.resolve_attention_backend("reference", "cpu") == ("reference", "reference")
    with pytest.raises(ValueError, match="simulator"):
        engine_device.resolve_attention_backend("cuda", "cpu")  # this process has no simulator
    with pytest.raises(ValueError, match="accepted with device='gpu': auto, cuda"):
        engine_device.resolve_attention_backend("cpu", "gpu")
    with pytest.raises(ValueError, match="attention_backend must be one of auto, cpu, cuda, reference"):
        EngineConfig(attention_backend="triton")
    parser = add_engine_args(__import__("argparse").ArgumentParser())
    assert config_from_args(parser.parse_args(["--attention-backend", "reference"])).attention_backend == "reference"


def test_reference_backend_serves_the_same_greedy_tokens(tmp_path):
    from engine import SamplingParams

    tiny = make_tiny_model(str(tmp_path / "llama"), seed=3)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    cpu = LLM(model=tiny, attention_backend="cpu", max_num_batched_tokens=8)
    ref = LLM(model=tiny, attention_backend="reference", max_num_batched_tokens=8)
    assert (cpu.snapshot().attention_backend, ref.snapshot().attention_backend) == ("cpu", "reference")
    assert ref.snapshot().to_dict()["attention_backend"] == "reference"
    prompts = tiny_prompts(2)
    assert ([o.outputs[0].token_ids for o in ref.generate(prompts, greedy)]
            == [o.outputs[0].token_ids for o in cpu.generate(prompts, greedy)])


def test_a_failing_attention_kernel_fails_the_load_with_its_cause(tmp_path, monkeypatch):
    import gpu_kernels

    def broken(*args, **kwargs):
        raise OSError("no kernel image is available for execution on the device")

    monkeypatch.setattr(gpu_kernels, "paged_decode", broken)
    with pytest.raises(RuntimeError, match="warm-up step on device='cpu'.*OSError: no kernel image"):
        LLM(model=make_tiny_model(str(tmp_path / "llama"), seed=3))
