"""Engine settings: one source (EngineConfig's fields) for LLM kwargs and every command's flags,
FastDeploy's names included; the scheduler's kv_cache_ratio admission rule."""

import argparse

import pytest

from engine.config import EngineConfig, FlagParser, accepted_only_notes, add_engine_args, config_from_args
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


def _flag_parser():
    p = add_engine_args(FlagParser(prog="python -m playground"))
    p.add_argument("--port", type=int, help="port")
    return p


@pytest.mark.parametrize("argv,said", [
    (["--max-model-lenght", "64"], "unknown flag --max-model-lenght; did you mean --max-model-len?"),
    (["--gpu-memory-utilisation=0.5"], "unknown flag --gpu-memory-utilisation; did you mean --gpu-memory-utilization?"),
    (["--prot", "8000"], "unknown flag --prot; did you mean --port?"),
    (["--block-size", "8", "--kv-cache-ratoi", "0.5", "--zzzz"],
     "unknown flag --kv-cache-ratoi; did you mean --kv-cache-ratio?; unknown flag --zzzz"),
    (["extra.gguf"], "unexpected argument: extra.gguf"),
])
def test_an_unknown_flag_is_refused_naming_the_nearest_known_one(capsys, argv, said):
    with pytest.raises(SystemExit) as info:
        _flag_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err == f"python -m playground: error: {said} (--help lists every flag)\n"


def test_other_errors_are_one_line_too(capsys):
    with pytest.raises(SystemExit):
        _flag_parser().parse_args(["--model-impl", "fastdeplo"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice: 'fastdeplo'" in err and "usage:" not in err


def _parsers() -> dict:
    """The command lines built on the engine's flags (each one's parser, not parsed)."""
    import app
    from engine.entrypoints.openai.api_server import make_arg_parser
    from playground.__main__ import parse_args

    built = {"python -m engine.entrypoints.openai.api_server": make_arg_parser()}
    capture = pytest.MonkeyPatch()
    capture.setattr(FlagParser, "parse_args", lambda self, *args, **kwargs: self)
    try:
        built["python -m playground"] = parse_args([])
        built["python app.py"] = app.parse_args([])
    finally:
        capture.undo()
    return built


def test_every_flag_has_help():
    for prog, p in _parsers().items():
        assert isinstance(p, FlagParser), prog
        for action in p._actions:
            if action.help is not argparse.SUPPRESS:
                assert action.help and "``" not in action.help, (prog, action.option_strings)
        assert "``" not in (p.description or ""), prog


def test_every_command_line_is_a_flag_parser():
    """No command builds a plain argparse parser (which would refuse a typo without a suggestion)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sources = [root / "app.py", *(root / d for d in ("benchmarks", "engine", "playground") for _ in [0])]
    files = [p for s in sources for p in ([s] if s.is_file() else s.rglob("*.py"))]
    plain = [str(p.relative_to(root)) for p in files if "argparse.ArgumentParser(" in p.read_text()]
    assert len(files) > 50 and not plain, plain
