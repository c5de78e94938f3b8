"""Tensor parallelism (engine.parallel), on 127.0.0.1 with two or three processes: the same greedy
tokens as one process (logprobs within 1e-4: the all-reduce sums in another order) with prefix
caching, chunked prefill and preemption at work; the checks that refuse a size before anything
loads; a rank killed mid-request failing its request with the rank named, nothing left running
or listening; the step record every rank runs."""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.parallel import RankFailure
from tiny_models import make_tiny_model, tiny_prompts

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    dirs = {arch: make_tiny_model(str(root / arch), arch) for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM")}
    # Gemma 3's layout with one KV head (as Gemma 3 270M): replicated at two ranks
    dirs["Gemma3ForCausalLM"] = make_tiny_model(str(root / "gemma3"), "Gemma3ForCausalLM", kv_heads=1)
    return dirs


def events_of(llm):
    seen = []
    llm.subscribe(seen.append)
    return seen


def assert_same_greedy(ref, out, tol=1e-4):
    for a, b in zip(ref, out, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert cb.finish_reason == ca.finish_reason != "error", cb
        assert cb.token_ids == ca.token_ids
        la = [lp[t].logprob for lp, t in zip(ca.logprobs, ca.token_ids)]
        lb = [lp[t].logprob for lp, t in zip(cb.logprobs, cb.token_ids)]
        assert np.allclose(la, lb, rtol=0, atol=tol), max(abs(x - y) for x, y in zip(la, lb))


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def ports_of(llm) -> list[int]:
    """The ports the engine's ranks listen on: the store's (hosted by rank 1). The channel's listening
    port closes once every rank has connected."""
    ranks = llm.engine.tensor_parallel.ranks
    assert not listening(int(ranks.channel_address.rsplit(":", 1)[1]))
    return [int(ranks.store_address.rsplit(":", 1)[1])]


@pytest.mark.parametrize("arch, impl", [("LlamaForCausalLM", "native"), ("Qwen3ForCausalLM", "native"),
                                        ("Gemma3ForCausalLM", "paddleformers")])
def test_two_ranks_give_one_process_greedy_tokens_with_caching_chunking_and_preemption(tiny_dirs, arch, impl):
    # 2 layers x 2 KV heads x 16 dims: a 4-token block is 2,048 bytes on one rank, 1,024 on each of
    # two (each holds one KV head), so both caches have 24 blocks -- too few for 6 requests of
    # ~40 tokens at once: the scheduler preempts. The shared 9-token prefix fills two blocks that
    # later prompts find in the prefix cache; 8-token steps cut every prompt into chunks. Gemma's
    # one KV head is on both ranks (replicated): 1,024 bytes a block on one rank and on each of two;
    # PaddleFormers' Gemma 3 owns a qkv_proj fused per KV head, built from a rank's slices.
    prompts = tiny_prompts(6)
    common = dict(model=tiny_dirs[arch], block_size=4, max_num_batched_tokens=8, enable_prefix_caching=True,
                  model_impl=impl)
    one_block = 1024 if arch == "Gemma3ForCausalLM" else 2048
    one = LLM(kv_cache_memory=24 * one_block, **common)
    ref = one.generate(prompts, GREEDY)
    two = LLM(kv_cache_memory=24 * 1024, tensor_parallel_size=2, **common)
    try:
        seen = events_of(two)
        assert two.engine.kv_cache_manager.num_blocks == one.engine.kv_cache_manager.num_blocks == 24
        out = two.generate(prompts, GREEDY)
        assert_same_greedy(ref, out)
        kinds = [e.kind for e in seen]
        assert "request_preempted" in kinds
        assert two.snapshot().prefix_cache.hits > 0
        prefill_steps = {}
        for e in seen:
            if e.kind == "step":
                assert e.data["num_tokens"] <= 8
                for rid in e.data["prefill"]:
                    prefill_steps[rid] = prefill_steps.get(rid, 0) + 1
        assert max(prefill_steps.values()) >= 3               # a 20-token prompt in 8-token chunks
        assert two.snapshot().decode_path.startswith("paddle (tensor_parallel_size=2")
        runner = two.engine.runner
        assert runner.kv_caches[0][0].shape[1] == 1      # one KV head of the two on each rank
        assert runner.totals["steps"] > 0 and runner.totals["comm_s"] > 0
    finally:
        two.engine.tensor_parallel.close()


def test_more_ranks_than_kv_heads_replicate_them(tiny_dirs):
    """4 query heads, 2 KV heads, 4 ranks: one query head and one (shared) KV head a rank, as
    FastDeploy replicates KV heads; the greedy tokens stay those of one process."""
    prompts = tiny_prompts(2)
    common = dict(model=tiny_dirs["LlamaForCausalLM"], block_size=4, kv_cache_memory=200_000)
    ref = LLM(**common).generate(prompts, GREEDY)
    four = LLM(tensor_parallel_size=4, **common)
    try:
        assert four.engine.runner.model.plan.kv_replicas == 2
        assert_same_greedy(ref, four.generate(prompts, GREEDY))
    finally:
        four.engine.tensor_parallel.close()


@pytest.mark.slow
def test_smollm2_on_three_ranks_gives_one_process_greedy_tokens():
    """The default model: 9 query heads and 3 KV heads, three a rank and one a rank. Compared with
    one process on the same float32 weights (the GGUF's blocks dequantized; the Paddle layers)."""
    prompts = ["The capital of France is", "The capital of France is a city that", "def fibonacci(n):"]
    common = dict(model="smollm2-135m-instruct", block_size=4, max_num_batched_tokens=8, kv_cache_memory=8_000_000)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
    ref = LLM(quantization="none", cpu_decode="paddle", **common).generate(prompts, params)
    three = LLM(tensor_parallel_size=3, **common)
    try:
        assert three.engine.runner.model.plan.heads == 3 and three.engine.runner.model.plan.kv_heads == 1
        assert_same_greedy(ref, three.generate(prompts, params))
        assert three.snapshot().prefix_cache.hits > 0
    finally:
        three.engine.tensor_parallel.close()


@pytest.mark.slow
def test_gemma3_through_paddleformers_on_two_ranks_gives_one_process_greedy_tokens():
    """Gemma 3 270M (PaddleFormers' class: 4 query heads, one KV head, replicated on both ranks), with
    prefix caching, 8-token chunks and a cache of 10 blocks, too few for three requests at once (the
    scheduler preempts); against one process on the same float32 weights through the Paddle layers."""
    prompts = ["The capital of France is", "The capital of France is a city that", "def fibonacci(n):"]
    block = 18 * 1 * 256 * 2 * 4 * 4       # layers x KV heads x head_dim x (K, V) x float32 x 4 tokens
    common = dict(model="gemma3-270m", block_size=4, max_num_batched_tokens=8, enable_prefix_caching=True,
                  kv_cache_memory=10 * block, model_impl="paddleformers")
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    ref = LLM(quantization="none", cpu_decode="paddle", **common).generate(prompts, params)
    two = LLM(tensor_parallel_size=2, **common)
    try:
        seen = events_of(two)
        assert two.engine.kv_cache_manager.num_blocks == 10
        assert two.engine.runner.model.plan.heads == 2 and two.engine.runner.model.plan.kv_replicas == 2
        assert_same_greedy(ref, two.generate(prompts, params))
        assert "request_preempted" in [e.kind for e in seen]
        assert two.snapshot().prefix_cache.hits > 0
    finally:
        two.engine.tensor_parallel.close()


# -- refused before anything loads -----------------------------------------------------------
@pytest.fixture
def no_ranks_start(monkeypatch):
    import engine.parallel.runner as runner

    def refuse(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(runner, "LocalRanks", refuse)
    monkeypatch.setattr(runner, "build_sharded_model", refuse)


def test_a_size_that_does_not_split_the_heads_is_refused_before_loading(tiny_dirs, no_ranks_start):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 cannot split LlamaForCausalLM: "
                                         r"num_attention_heads=4 is not a multiple of it.*Sizes that split it: 1, 2, 4"):
        LLM(model=tiny_dirs["LlamaForCausalLM"], tensor_parallel_size=3)


def test_smollm2_at_two_ranks_is_refused_naming_the_sizes_that_work(no_ranks_start):
    with pytest.raises(ValueError, match=r"num_attention_heads=9 is not a multiple of it.*"
                                         r"Sizes that split it: 1, 3"):
        LLM(model="smollm2-135m-instruct", tensor_parallel_size=2)


def test_more_ranks_than_the_cores_run_is_refused(monkeypatch):
    import engine.config as config

    monkeypatch.setattr(config, "usable_cores", lambda: 1)
    EngineConfig(tensor_parallel_size=2)                      # two ranks may share a core
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 is more ranks than this machine's 1 usable "
                                         r"core\(s\) run: at most 2 ranks a core"):
        EngineConfig(tensor_parallel_size=3)


def test_a_size_that_does_not_split_a_borrowed_model_is_refused_before_loading(tiny_dirs, no_ranks_start,
                                                                               monkeypatch):
    import engine.fallback.paddleformers as pf

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(pf, "build_paddleformers_model", refuse)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 cannot split Gemma3ForCausalLM: "
                                         r"num_attention_heads=4 is not a multiple of it; intermediate_size=128 "
                                         r"is not a multiple of it. Sizes that split it: 1, 2, 4"):
        LLM(model=tiny_dirs["Gemma3ForCausalLM"], model_impl="paddleformers", tensor_parallel_size=3)


def test_a_borrowed_class_that_cannot_be_built_at_a_ranks_sizes_is_refused_before_loading(tiny_dirs,
                                                                                         no_ranks_start):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: PaddleFormers' LlamaForCausalLM cannot be built "
                                         r"with a rank's share of the model \(2 query heads, 1 KV heads of 16, "
                                         r"hidden size 64\): hidden_size must be divisible"):
        LLM(model=tiny_dirs["LlamaForCausalLM"], model_impl="paddleformers", tensor_parallel_size=2)


def test_a_backend_without_a_sharded_model_is_refused(tiny_dirs, no_ranks_start):
    from engine.parallel.sharding import check_shardable

    with pytest.raises(ValueError, match="model_impl='paddlefleet' has no sharded implementation yet"):
        check_shardable("LlamaForCausalLM", {}, 2, "paddlefleet")


# -- a rank dies --------------------------------------------------------------------------------
def test_a_rank_killed_mid_request_fails_it_naming_the_rank_and_leaves_nothing_running(tiny_dirs):
    llm = LLM(model=tiny_dirs["LlamaForCausalLM"], tensor_parallel_size=2, block_size=4, kv_cache_memory=200_000)
    ranks = llm.engine.tensor_parallel.ranks
    ports = ports_of(llm)
    assert all(listening(p) for p in ports)
    deltas = []

    def consume():
        for delta in llm.stream(tiny_prompts(1)[0], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)):
            deltas.append(delta)
            if len(deltas) == 3:
                os.kill(ranks.procs[1].pid, signal.SIGKILL)

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    reader.join(120)      # a guard against a hang, not a speed goal
    assert not reader.is_alive(), "the stream never ended after its rank was killed"
    last = deltas[-1]
    assert last.finished and last.finish_reason == "error"
    assert "tensor-parallel rank 1 was killed by SIGKILL" in last.error and len(deltas) < 400
    # the engine says the same at once for a later request; every rank is stopped; nothing listens
    later = llm.generate(tiny_prompts(1), GREEDY)[0].outputs[0]
    assert later.finish_reason == "error"
    assert all(p.poll() is not None for p in ranks.procs.values())
    assert not any(listening(p) for p in ports)
    with pytest.raises(RankFailure, match="rank 1 was killed by SIGKILL"):
        llm.engine.runner.run(None)


def test_closing_stops_the_ranks_and_releases_the_ports(tiny_dirs):
    llm = LLM(model=tiny_dirs["Qwen3ForCausalLM"], tensor_parallel_size=2, block_size=4, kv_cache_memory=200_000)
    ranks = llm.engine.tensor_parallel.ranks
    ports = ports_of(llm)
    assert llm.generate(tiny_prompts(1), GREEDY)[0].outputs[0].finish_reason == "length"
    stats = llm.engine.tensor_parallel.stats()
    assert stats[1]["steps"] == llm.engine.runner.totals["steps"] and stats[1]["calls"] == stats[0]["calls"]
    # the snapshot carries each rank's cache and the collectives' time, through JSON as a server sends it
    from engine.client.wire import snapshot_from_dict, snapshot_to_dict

    snap = llm.snapshot()
    info = snap.tensor_parallel
    cache = sum(int(np.prod(t.shape)) * 4 for kv in llm.engine.runner.kv_caches for t in kv)
    assert info["size"] == 2 and [(r["rank"], r["kv_heads"], r["kv_bytes"]) for r in info["ranks"]] == \
        [(0, 1, cache), (1, 1, cache)]
    assert info["last_step"]["collectives"] == 2 * 2 + 2           # 2 a layer, the embedding's, the logits'
    steps = info["totals"]["steps"]
    assert steps == stats[1]["steps"] and 5 * steps <= info["totals"]["collectives"] <= 6 * steps
    assert snapshot_from_dict(json.loads(json.dumps(snapshot_to_dict(snap)))).tensor_parallel == info
    llm.shutdown()                                               # stops the ranks too
    assert [p.returncode for p in ranks.procs.values()] == [0]   # it left on the closed channel, not a signal
    assert not any(listening(p) for p in ports)


RANK0 = """
import json, sys
from engine import LLM, SamplingParams
llm = LLM(model=sys.argv[1], tensor_parallel_size=2, block_size=4, kv_cache_memory=200_000)
out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[2])}], SamplingParams(max_tokens=16, temperature=0))
print(json.dumps(out[0].outputs[0].token_ids))
"""


@pytest.mark.slow
def test_ranks_started_by_a_launcher_serve_as_those_started_by_the_engine(tiny_dirs):
    """Two processes given only the trainer environment (what paddle.distributed.launch sets on each
    machine, plus the step channel's address and secret), here both on 127.0.0.1: rank 0 runs the
    engine and finds rank 1 instead of starting it; the greedy tokens are one process's."""
    model, prompt = tiny_dirs["LlamaForCausalLM"], tiny_prompts(1)[0]["prompt_token_ids"]
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        store, channel = a.getsockname()[1], b.getsockname()[1]
    env = {**os.environ, "PADDLE_TRAINERS_NUM": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store),
           "ENGINE_TP_CHANNEL": f"127.0.0.1:{channel}", "ENGINE_TP_TOKEN": "shared-secret",
           "PYTHONPATH": str(ROOT)}
    rank1 = subprocess.Popen([sys.executable, "-m", "engine.parallel.worker"], env={**env, "PADDLE_TRAINER_ID": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rank0 = subprocess.run([sys.executable, "-c", RANK0, model, str(prompt)], env={**env, "PADDLE_TRAINER_ID": "0"},
                           capture_output=True, text=True, timeout=300)
    log1 = rank1.communicate(timeout=60)[0]
    assert rank0.returncode == 0, rank0.stderr[-3000:]
    assert rank1.returncode == 0, log1[-3000:]                # it left when rank 0's channel closed
    local = LLM(model=model, block_size=4, kv_cache_memory=200_000).generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=16, temperature=0))[0].outputs[0]
    assert json.loads(rank0.stdout.strip().splitlines()[-1]) == local.token_ids


# -- the record every rank runs ----------------------------------------------------------------
def test_the_step_record_is_plain_data_that_runs_the_same_anywhere(tiny_dirs):
    from engine.step_record import StepRecord

    llm = LLM(model=tiny_dirs["LlamaForCausalLM"], block_size=4, max_num_batched_tokens=8, kv_cache_memory=200_000)
    engine = llm.engine
    prompts = tiny_prompts(2)
    for p in prompts:
        engine.add_request(p["prompt_token_ids"], SamplingParams(max_tokens=2, prompt_logprobs=1))
    batch = engine.scheduler.schedule()
    record = StepRecord.from_batch(batch, 4)
    copy = pickle.loads(pickle.dumps(record))
    assert b"Request" not in pickle.dumps(record)
    assert copy.num_tokens == 8 and not copy.decode_only
    assert copy.rows.tolist() == list(range(8))            # 8 prompt-logprob rows, no request completes yet
    assert copy.num_prompt_rows == 8 and copy.sample_request_ids == ()
    assert np.array_equal(copy.slots, record.slots) and np.array_equal(copy.block_tables, record.block_tables)
    logits = engine.runner.run(copy)                        # the runner needs nothing but the record
    assert logits.shape == (8, 256) and np.isfinite(logits).all()
    for rid in list(engine.requests):
        engine.abort(rid)


# -- the server ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_server_serves_with_two_ranks_and_stops_them(tiny_dirs):
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mark = f"tp-server-{os.getpid()}-{port}"   # every process of this server carries it in its environment
    proc = subprocess.Popen([sys.executable, "-m", "engine.entrypoints.openai.api_server", "--model",
                             tiny_dirs["LlamaForCausalLM"], "--port", str(port), "-tp", "2", "--block-size", "4",
                             "--kv-cache-memory", "200000"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "TP_TEST_MARK": mark})
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None
            threading.Event().wait(0.5)
        assert len(marked(mark)) >= 2                     # the server (rank 0) and rank 1
        prompt = tiny_prompts(1)[0]["prompt_token_ids"]
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
        reply = httpx.post(base + "/v1/completions", json=body, timeout=120).json()
        local = LLM(model=tiny_dirs["LlamaForCausalLM"], block_size=4, kv_cache_memory=200_000).generate(
            [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
        assert reply["choices"][0]["text"] == local.text
    finally:
        proc.terminate()
        log = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, log
    for _ in range(20):          # rank 1 leaves on the closed channel
        if not marked(mark):
            break
        threading.Event().wait(0.5)
    assert not marked(mark), log


def marked(mark: str) -> list[int]:
    """Processes whose environment holds ``TP_TEST_MARK=mark``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if f"TP_TEST_MARK={mark}".encode() in fh.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass
    return found


# -- the benchmark's model ----------------------------------------------------------------------
def test_the_benchmark_measures_smollm2_where_it_splits_and_a_stand_in_of_its_size_elsewhere():
    from benchmarks.tensor_parallel import splits, stand_in_shape

    smollm2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}
    assert splits(smollm2, 3) and not splits(smollm2, 2)
    assert stand_in_shape(smollm2, [1, 2]) == (12, 4, 1536)       # head_dim 48, one KV head for 3 query heads
    assert stand_in_shape(smollm2, [1, 2, 4]) == (12, 4, 1536)
    heads, kv, inter = stand_in_shape(smollm2, [1, 2, 3])
    assert all(splits({**smollm2, "num_attention_heads": heads, "num_key_value_heads": kv,
                       "intermediate_size": inter}, n) for n in (2, 3)) and 576 % heads == 0
