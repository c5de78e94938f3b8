"""Engine settings: one source (EngineConfig's fields) for LLM kwargs and every command's flags,
FastDeploy's names included; the scheduler's kv_cache_ratio admission rule."""

import argparse

import pytest

from engine.config import EngineConfig, accepted_only_notes, add_engine_args, config_from_args
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

SEED_FLAGS = ("--model x.gguf --port 8582 --metrics-port 28582 --max-model-len 32768 --max-num-seqs 256 "
              "--kv-cache-ratio 0.75 --tensor-parallel-size 1 --gpu-memory-utilization 0.9 "
              "--model-impl paddleformers").split()


def parser():
    p = add_engine_args(argparse.ArgumentParser())
    p.add_argument("--port", type=int)
    p.add_argument("--metrics-port", type=int)
    return p


def test_every_field_is_a_flag_with_the_fields_default_and_help():
    args = parser().parse_args([])
    assert config_from_args(args) == EngineConfig()
    for action in parser()._actions:
        if action.dest in EngineConfig.__dataclass_fields__:
            assert action.help, action.dest


def test_fastdeploy_seed_command_line_parses():
    config = config_from_args(parser().parse_args(SEED_FLAGS))
    assert (config.max_model_len, config.max_num_seqs, config.kv_cache_ratio, config.gpu_memory_utilization,
            config.model_impl, config.tensor_parallel_size) == (32768, 256, 0.75, 0.9, "paddleformers", 1)


def test_fastdeploy_spellings():
    args = parser().parse_args(["--model-impl", "fastdeploy", "--no-enable-prefix-caching", "-tp", "1",
                                "--enable-chunked-prefill", "--engine-worker-queue-port", "8002"])
    config = config_from_args(args)
    assert config.model_impl == "native" and config.enable_prefix_caching is False
    notes = accepted_only_notes(args)
    assert len(notes) == 2 and notes[0].startswith("--enable-chunked-prefill") and "no meaning" in notes[1]
    assert parser().parse_args(["--no-prefix-caching"]).enable_prefix_caching is False


@pytest.mark.parametrize("kwargs, field", [
    ({"tensor_parallel_size": 999}, "tensor_parallel_size=999 is more ranks than"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"kv_cache_ratio": 0}, "kv_cache_ratio"),
    ({"kv_cache_ratio": float("nan")}, "kv_cache_ratio"),
])
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_gpu_memory_utilization_sizes_only_a_gpu_cache():
    config = EngineConfig(gpu_memory_utilization=0.5, kv_cache_memory=1000)
    assert config.kv_cache_bytes("gpu", 10_000, weight_bytes=1_000) == 4_000
    assert config.kv_cache_bytes("cpu", 10_000) == 1000


def _admitted(kv_cache_ratio):
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=1000, kv_cache_ratio=kv_cache_ratio)
    for i in range(4):   # 8 tokens each: 2 blocks (plus room to grow)
        sched.add_request(Request(f"r{i}", list(range(1, 9)), SamplingParams(max_tokens=100)))
    return [r.request_id for r in sched.schedule().started]


def test_kv_cache_ratio_keeps_a_reserve_for_running_requests():
    assert _admitted(1.0) == ["r0", "r1", "r2", "r3"]   # 8 of 10 blocks
    assert _admitted(0.5) == ["r0", "r1", "r2"]          # stops once 6 of 10 (>= half) are used
    assert _admitted(0.1) == ["r0"]                      # the first always starts
