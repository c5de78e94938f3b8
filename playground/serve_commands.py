""""Take it further": the same model and engine settings on a serving stack.

The playground is one process; a user who outgrows it moves to a server that
batches across machines. ``serve_commands(config)`` writes the FastDeploy and
vLLM command lines that match the running engine's settings (block size,
prefix caching, batch limits, context length, model implementation), with
flag names from each project's documentation (FastDeploy
docs/parameters.md; vLLM ``vllm serve --help``).
"""

from __future__ import annotations

from html import escape
from typing import Any

__all__ = ["serve_commands", "serve_commands_html", "HF_REPOS"]

# Zoo names -> the Hugging Face repository of the same weights (unquantized).
HF_REPOS = {
    "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "gemma3-270m": "google/gemma-3-270m",
}
# Our model_impl -> vLLM's --model-impl: native models ~ vLLM's own, borrowed ones ~ the library's.
VLLM_IMPL = {"native": "vllm", "paddleformers": "transformers", "paddlefleet": "transformers"}


def _settings(llm: Any) -> dict:
    config = llm.config
    return {
        "model": HF_REPOS.get(str(config.model), str(config.model)),
        "block_size": config.block_size,
        "prefix": bool(config.enable_prefix_caching),
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": getattr(config, "max_num_batched_tokens", None),
        "max_model_len": llm.max_model_len,
        "impl": llm.model_impl,
    }


def serve_commands(llm: Any) -> dict[str, str]:
    """``{"FastDeploy": cmd, "vLLM": cmd}`` for the engine's current settings."""
    s = _settings(llm)
    common = [f"--max-model-len {s['max_model_len']}"] if s["max_model_len"] else []
    common += [f"--max-num-seqs {s['max_num_seqs']}", f"--block-size {s['block_size']}"]
    if s["max_num_batched_tokens"]:
        common.append(f"--max-num-batched-tokens {s['max_num_batched_tokens']}")
    fastdeploy = ["fastdeploy serve", f"--model {s['model']}", *common, "--enable-logprob"]
    if s["prefix"]:
        fastdeploy.append("--enable-prefix-caching")
    vllm = ["vllm serve", s["model"], *common,
            "--enable-prefix-caching" if s["prefix"] else "--no-enable-prefix-caching",
            f"--model-impl {VLLM_IMPL.get(s['impl'], 'auto')}"]
    return {"FastDeploy": " \\\n    ".join(fastdeploy), "vLLM": " \\\n    ".join(vllm)}


def serve_commands_html(llm: Any) -> str:
    blocks = "".join(
        f'<div class="pg-sub">{escape(name)}</div><pre class="serve-cmd" data-server="{escape(name)}" '
        f'style="background:#0f172a;color:#e2e8f0;padding:6px 8px;border-radius:6px;font-size:12px;'
        f'white-space:pre-wrap;margin:2px 0 6px">{escape(cmd)}</pre>'
        for name, cmd in serve_commands(llm).items())
    return (f'<div class="pg-panel" style="font-family:ui-sans-serif,system-ui,sans-serif;font-size:13px">{blocks}'
            '<div style="color:#64748b;font-size:12px">Both serve an OpenAI-compatible API on GPUs and shard across '
            "them (<code>--tensor-parallel-size</code>); check that the server supports the model first.</div></div>")
