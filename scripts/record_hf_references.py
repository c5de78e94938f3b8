"""Record HF transformers' answers for the tests that compare with it, into tests/fixtures/hf/.

Needs the "reference" extra (CPU torch is enough)::

    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && pip install -e ".[test,reference]"
    python scripts/record_hf_references.py              # every test marked `reference`
    python scripts/record_hf_references.py -k qwen      # some of them (pytest's own arguments)

It runs the tests marked ``reference`` with ``HF_REFERENCE=record``: each computes transformers'
answer live, as it does whenever the extra is installed, and writes it with the inputs it was
computed for (tests/hf_recorded.py); the tiny random models that transformers builds and saves
are written there too. Then MANIFEST.json lists the versions that answered and every file's
size and sha256 (tests/test_environment.py checks the files against it).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
VERSIONS = ("transformers", "torch", "tokenizers", "gguf", "safetensors", "numpy", "paddlepaddle")


def manifest() -> dict:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    files = {}
    for path in sorted(FIXTURES.rglob("*")):
        if path.is_file() and path.name != "MANIFEST.json":
            data = path.read_bytes()
            files[path.relative_to(FIXTURES).as_posix()] = {"bytes": len(data),
                                                            "sha256": hashlib.sha256(data).hexdigest()}
    return {"recorded": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "python": platform.python_version(), "machine": platform.machine(),
            "versions": {name: version(name) for name in VERSIONS},
            "files": files}


def main() -> int:
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["reference"]
    torch = next(r for r in extra if r.startswith("torch"))
    for name in ("torch", "transformers"):
        try:
            version(name)
        except Exception:   # noqa: BLE001  PackageNotFoundError
            sys.exit(f"recording needs the reference extra ({name} is missing): pip install '{torch}' "
                     "--index-url https://download.pytorch.org/whl/cpu && pip install -e '.[reference]'")
    env = dict(os.environ, HF_REFERENCE="record")
    returncode = subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "reference", *sys.argv[1:]],
                                 cwd=ROOT, env=env)
    if returncode != 0:
        print(f"pytest exited with {returncode}: MANIFEST.json not written", file=sys.stderr)
        return returncode
    document = manifest()
    (FIXTURES / "MANIFEST.json").write_text(json.dumps(document, indent=1) + "\n")
    total = sum(f["bytes"] for f in document["files"].values())
    print(f"{len(document['files'])} files, {total / 1e6:.1f} MB, in {FIXTURES.relative_to(ROOT)}; "
          f"transformers {document['versions']['transformers']}, torch {document['versions']['torch']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
