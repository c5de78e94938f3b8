"""HF transformers' answers for the tests that compare with it: computed live where the
"reference" extra (torch) is installed, read from their recording otherwise.

    answer = hf_recorded.answer("smollm2-logits", inputs, lambda: ...torch...)

``inputs`` is what the test feeds transformers (token ids, texts, digests of our weights or of a
model directory); the callable computes transformers' answer for them. The assertions that
follow are the same whichever way the answer came. Where it is read from its recording
(``tests/fixtures/hf/NAME.json``, arrays beside it in ``NAME.npz``), the recorded inputs must equal
the test's inputs, so a test whose inputs change fails until its answer is recorded again.
Where it is computed live, it must equal the recording (floats within ``atol``), so a recording
cannot go stale unnoticed while CI runs the live comparison.

``HF_REFERENCE`` picks the mode: ``live`` (torch required: CI's comparison run), ``recorded`` (the
recordings, even with torch installed), ``record`` (computed live and written:
``scripts/record_hf_references.py``); unset, live where torch is installed, else recorded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
MODES = ("live", "recorded", "record")
RECORD_COMMAND = "python scripts/record_hf_references.py"


def mode() -> str:
    asked = os.environ.get("HF_REFERENCE", "").strip()
    if asked and asked not in MODES:
        raise ValueError(f"HF_REFERENCE={asked!r}: expected one of {', '.join(MODES)} (or unset)")
    if asked:
        return asked
    return "live" if importlib.util.find_spec("torch") is not None else "recorded"


def live() -> bool:
    """Whether transformers' answers are computed now (torch is needed) rather than read."""
    return mode() != "recorded"


def recording() -> bool:
    return mode() == "record"


def gguf_inputs(path) -> dict:
    """What identifies a GGUF file transformers reads (the zoo pins its package's version)."""
    return {"file": os.path.basename(path), "bytes": os.path.getsize(path)}


def file_digest(*paths) -> str:
    """sha256 over the bytes of ``paths`` (a model directory's files), for a test's inputs."""
    sha = hashlib.sha256()
    for path in paths:
        sha.update(Path(path).read_bytes())
    return sha.hexdigest()


def answer(name: str, inputs, compute, *, atol: float = 1e-5):
    """transformers' answer for ``inputs`` (see the module's docstring)."""
    inputs = _plain(inputs)
    if not live():
        recorded = load(name)
        if recorded["inputs"] != inputs:
            raise AssertionError(f"{_json_path(name)} was recorded for other inputs than this test's; record "
                                 f"it again where the reference extra is installed: {RECORD_COMMAND}")
        return recorded["answer"]
    computed = _restore(*_split(compute()))     # the same types as a recording gives
    if recording():
        save(name, inputs, computed)
        return computed
    recorded = load(name)
    if recorded["inputs"] != inputs:
        raise AssertionError(f"{_json_path(name)} was recorded for other inputs than this test's: {RECORD_COMMAND}")
    difference = _difference(recorded["answer"], computed, atol)
    if difference:
        raise AssertionError(f"{_json_path(name)} is stale: transformers now answers differently at {difference}; "
                             f"{RECORD_COMMAND}")
    return computed


def load(name: str) -> dict:
    path = _json_path(name)
    if not path.is_file():
        raise AssertionError(f"no recording of transformers' answer at {path}: {RECORD_COMMAND}")
    document = json.loads(path.read_text())
    arrays = {}
    if path.with_suffix(".npz").is_file():
        with np.load(path.with_suffix(".npz")) as npz:
            arrays = {key: npz[key] for key in npz.files}
    return {"inputs": document["inputs"], "answer": _restore(document["answer"], arrays)}


def save(name: str, inputs, computed) -> None:
    plain, arrays = _split(computed)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    path = _json_path(name)
    path.write_text(json.dumps({"inputs": inputs, "answer": plain}, indent=1, ensure_ascii=False) + "\n")
    if arrays:
        np.savez_compressed(path.with_suffix(".npz"), **arrays)
    elif path.with_suffix(".npz").exists():
        path.with_suffix(".npz").unlink()


def _json_path(name: str) -> Path:
    return FIXTURES / f"{name}.json"


def _plain(value):
    return json.loads(json.dumps(value))


def _split(value, arrays=None, prefix="a"):
    """``value`` with each numpy array replaced by ``{"array": key}``; the arrays by key (float32)."""
    arrays = {} if arrays is None else arrays
    if isinstance(value, np.ndarray):
        key = f"{prefix}{len(arrays)}"
        arrays[key] = value.astype(np.float32) if value.dtype.kind == "f" else value
        return {"array": key}, arrays
    if isinstance(value, dict):
        return {str(k): _split(v, arrays)[0] for k, v in value.items()}, arrays
    if isinstance(value, (list, tuple)):
        return [_split(v, arrays)[0] for v in value], arrays
    return _plain(value), arrays


def _restore(value, arrays):
    if isinstance(value, dict):
        if value.keys() == {"array"}:
            return arrays[value["array"]]
        return {k: _restore(v, arrays) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore(v, arrays) for v in value]
    return value


def _difference(recorded, computed, atol: float, where: str = "") -> str | None:
    """Where ``computed`` differs from ``recorded`` (None where it does not): floats by more than ``atol``."""
    if isinstance(recorded, np.ndarray) or isinstance(computed, np.ndarray):
        a, b = np.asarray(recorded), np.asarray(computed)
        if a.shape != b.shape:
            return f"{where or 'the answer'} (shape {a.shape} vs {b.shape})"
        if not np.allclose(a, b, rtol=0.0, atol=atol):
            return f"{where or 'the answer'} (max |difference| {np.abs(a - b).max():.3g})"
        return None
    if isinstance(recorded, dict) and isinstance(computed, dict):
        if recorded.keys() != computed.keys():
            return f"{where or 'the answer'} (keys {sorted(set(recorded) ^ set(computed))[:5]})"
        for key in recorded:
            found = _difference(recorded[key], computed[key], atol, f"{where}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(recorded, list) and isinstance(computed, list):
        if len(recorded) != len(computed):
            return f"{where or 'the answer'} (length {len(recorded)} vs {len(computed)})"
        for i, (a, b) in enumerate(zip(recorded, computed)):
            found = _difference(a, b, atol, f"{where}[{i}]")
            if found:
                return found
        return None
    if isinstance(recorded, float) or isinstance(computed, float):
        numbers = isinstance(recorded, (int, float)) and isinstance(computed, (int, float))
        ok = numbers and abs(recorded - computed) <= atol
        return None if ok else f"{where or 'the answer'} ({recorded!r} vs {computed!r})"
    return None if recorded == computed else f"{where or 'the answer'} ({recorded!r} vs {computed!r})"
