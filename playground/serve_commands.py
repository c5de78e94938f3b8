""""Take it further": the same model and engine settings on a serving stack.

The playground is one process; a user who outgrows it moves to a server.
``serve_commands(llm)`` writes this project's server command, FastDeploy's and
vLLM's, matching the running engine's settings (block size, prefix caching,
batch limits, context length, model implementation), with flag names from each
project's documentation (FastDeploy ``docs/parameters.md`` and its
``python -m fastdeploy.entrypoints.openai.api_server`` form; vLLM
``vllm serve --help``), then a curl and an ``openai`` client call that work
with any of them.
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
        "zoo": str(config.model),
        "model": HF_REPOS.get(str(config.model), str(config.model)),
        "block_size": config.block_size,
        "prefix": bool(config.enable_prefix_caching),
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": getattr(config, "max_num_batched_tokens", None),
        "max_model_len": llm.max_model_len,
        "impl": llm.model_impl,
    }


def serve_commands(llm: Any, port: int = 8000) -> dict[str, str]:
    """The engine's current settings as a server: this project's own, FastDeploy's and vLLM's command
    lines (each in the form its project documents: FastDeploy ``docs/online_serving``, vLLM
    ``vllm serve --help``), then a curl and an ``openai`` client call for any of them."""
    s = _settings(llm)
    common = [f"--max-model-len {s['max_model_len']}"] if s["max_model_len"] else []
    common += [f"--max-num-seqs {s['max_num_seqs']}", f"--block-size {s['block_size']}"]
    if s["max_num_batched_tokens"]:
        common.append(f"--max-num-batched-tokens {s['max_num_batched_tokens']}")
    prefix = "--enable-prefix-caching" if s["prefix"] else "--no-enable-prefix-caching"
    ours = ["python -m engine.entrypoints.openai.api_server", f"--model {s['zoo']}", f"--port {port}", *common,
            prefix]
    if s["impl"] in ("native", "paddleformers", "paddlefleet"):     # not another server's (engine.client.OpenAIServer)
        ours.append(f"--model-impl {s['impl']}")
    fastdeploy = ["python -m fastdeploy.entrypoints.openai.api_server", f"--model {s['model']}", f"--port {port}",
                  f"--metrics-port {port + 1}", f"--engine-worker-queue-port {port + 2}", *common, prefix,
                  "--enable-logprob"]
    if s["impl"] in ("paddleformers", "paddlefleet"):
        fastdeploy.append(f"--model-impl {s['impl']}")
    vllm = ["vllm serve", s["model"], f"--port {port}", *common, prefix,
            f"--model-impl {VLLM_IMPL.get(s['impl'], 'auto')}"]
    body = '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64}'
    client = (f'from openai import OpenAI\n\nclient = OpenAI(base_url="http://127.0.0.1:{port}/v1", api_key="unused")\n'
              'reply = client.chat.completions.create(model=client.models.list().data[0].id, logprobs=True,\n'
              '    top_logprobs=3, messages=[{"role": "user", "content": "Hello"}])\n'
              'print(reply.choices[0].message.content)')
    return {"This engine": " \\\n    ".join(ours), "FastDeploy": " \\\n    ".join(fastdeploy),
            "vLLM": " \\\n    ".join(vllm),
            "curl": f"curl -X POST http://127.0.0.1:{port}/v1/chat/completions \\\n    -d '{body}'",
            "openai client": client}


def serve_commands_html(llm: Any) -> str:
    blocks = "".join(
        f'<div class="pg-sub">{escape(name)}</div><pre class="serve-cmd" data-server="{escape(name)}" '
        f'style="background:#0f172a;color:#e2e8f0;padding:6px 8px;border-radius:6px;font-size:12px;'
        f'white-space:pre-wrap;margin:2px 0 6px">{escape(cmd)}</pre>'
        for name, cmd in serve_commands(llm).items())
    return (f'<div class="pg-panel" style="font-family:ui-sans-serif,system-ui,sans-serif;font-size:13px">{blocks}'
            '<div style="color:#64748b;font-size:12px">All three serve the same OpenAI-compatible API (the curl and '
            "client lines work with each); FastDeploy and vLLM run on GPUs and shard across them "
            "(<code>--tensor-parallel-size</code>): check that they support the model first. "
            "<code>python -m playground --server URL</code> shows any of them here.</div></div>")
