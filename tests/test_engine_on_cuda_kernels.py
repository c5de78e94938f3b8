"""The engine end to end on the CUDA attention kernels, in Numba's CUDA simulator.

``attention_backend="cuda"`` on the CPU runs the real ``numba.cuda`` kernels
(write_kv, decode, prefill) as Python threads over the CPU tensors
(``NUMBA_ENABLE_CUDASIM=1``, set before ``numba.cuda`` is first imported, so the
outer test re-runs this file in a subprocess, like ``test_kernels_cudasim.py``).
A tiny Llama-shaped model and a tiny Gemma3-shaped one (sliding window 4,
head_dim 256, through PaddleFormers) go through one schedule that has prefill
chunks, a pure decode step, a prefix-cache hit and a preemption (with its
recompute); ``attention_backend="cpu"`` runs the same schedule, and the greedy
tokens and every returned logprob must agree (<= 1e-4).
"""
import os

import numpy as np
import pytest

IN_SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"

if not IN_SIMULATOR:

    def test_engine_on_a_gpu(tmp_path):
        """Where paddlepaddle-gpu and numba-cuda see a GPU: the engine on it (Paddle tensors in GPU
        memory, float32 and bfloat16) serves the CPU engine's greedy tokens (float32)."""
        from engine.device import gpu_stack_problem

        problem = gpu_stack_problem()
        if problem:
            pytest.skip(f"no GPU stack: {problem}")
        from engine import LLM, SamplingParams
        from tiny_models import make_tiny_model, tiny_prompts

        tiny = make_tiny_model(str(tmp_path / "llama"), seed=3)
        greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        prompts = tiny_prompts(3)
        expected = [o.outputs[0].token_ids for o in LLM(model=tiny, device="cpu").generate(prompts, greedy)]
        gpu = LLM(model=tiny, device="gpu", dtype="float32", max_num_batched_tokens=16)
        assert gpu.snapshot().attention_backend == "cuda"
        assert [o.outputs[0].token_ids for o in gpu.generate(prompts, greedy)] == expected
        assert LLM(model=tiny, device="gpu").generate(prompts[0], greedy)[0].outputs[0].token_ids  # bf16 serves

    @pytest.mark.slow
    def test_engine_on_cuda_kernels_in_the_simulator(request, capsys):
        from conftest import relay_cudasim_run   # started beside the other tests, see conftest.py

        returncode, out = relay_cudasim_run(request.config, __file__, capsys)
        summary = out.strip().splitlines()[-1] if out.strip() else ""
        assert returncode == 0, out[-6000:]
        assert "2 passed" in summary and "skipped" not in summary, summary

else:
    from engine import LLM, SamplingParams
    from gpu_kernels.cuda import backend as cuda_backend
    from tiny_models import make_tiny_model

    BLOCK_SIZE = 4
    SHAPES = {  # (layers, heads, kv_heads, head_dim, hidden)
        "LlamaForCausalLM": (2, 2, 1, 8, 16),
        "Gemma3ForCausalLM": (2, 2, 1, 256, 32),
    }

    def run_schedule(model_dir, backend, shape):
        """Prompt P0 alone (two prefill chunks, then a decode), then P1 (P0's first two blocks
        plus three tokens: a prefix-cache hit) beside P2 in a 5-block cache (P2 is preempted
        and recomputed). Returns (outputs, step events, preemptions, the LLM)."""
        layers, _, kv_heads, head_dim, _ = shape
        block_bytes = 2 * layers * kv_heads * BLOCK_SIZE * head_dim * 4
        llm = LLM(model=model_dir, attention_backend=backend, block_size=BLOCK_SIZE, max_num_seqs=2,
                  max_num_batched_tokens=6, kv_cache_memory=5 * block_bytes)
        steps, preempted = [], []
        llm.subscribe(lambda e: steps.append(e.data) if e.kind == "step" else
                      preempted.append(e.data["request_id"]) if e.kind == "request_preempted" else None)
        rng = np.random.default_rng(5)
        p0 = rng.integers(7, 256, 9).tolist()
        p1, p2 = p0[:8] + rng.integers(7, 256, 3).tolist(), rng.integers(7, 256, 9).tolist()
        greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2)
        outs = llm.generate({"prompt_token_ids": p0}, greedy(2))
        outs += llm.generate([{"prompt_token_ids": p1}, {"prompt_token_ids": p2}], [greedy(3), greedy(1)])
        return outs, steps, preempted, llm

    @pytest.mark.parametrize("architecture", sorted(SHAPES))
    def test_cuda_kernels_serve_like_the_cpu_kernels(tmp_path, architecture):
        layers, heads, kv_heads, head_dim, hidden = SHAPES[architecture]
        model_dir = make_tiny_model(str(tmp_path / architecture), architecture, seed=3, hidden=hidden,
                                    layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
        cpu, cpu_steps, cpu_preempted, _ = run_schedule(model_dir, "cpu", SHAPES[architecture])
        cuda_backend.last_kernels.clear()
        cuda, cuda_steps, cuda_preempted, llm = run_schedule(model_dir, "cuda", SHAPES[architecture])

        assert llm.snapshot().attention_backend == "cuda"
        assert {"decode", "prefill"} <= set(cuda_backend.last_kernels)   # the CUDA kernels ran
        # the schedule reached what it is for, identically on both backends
        assert [s["num_tokens"] for s in cuda_steps] == [s["num_tokens"] for s in cpu_steps]
        assert max(s["num_tokens"] for s in cuda_steps) == 6 and cuda_steps[0]["prefill"]   # chunked prefill
        assert any(s["num_tokens"] == 1 for s in cuda_steps)                                 # a pure decode step
        assert cuda[1].num_cached_tokens == 8 == cpu[1].num_cached_tokens                    # prefix-cache hit
        assert cuda_preempted == cpu_preempted and cuda_preempted                            # preemption
        for a, b in zip(cpu, cuda):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert lp_a.keys() == lp_b.keys()
                for token in lp_a:
                    assert abs(lp_a[token].logprob - lp_b[token].logprob) <= 1e-4, (token, lp_a, lp_b)
