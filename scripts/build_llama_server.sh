#!/usr/bin/env bash
# Build llama.cpp's real `llama-server` from the sources vendored in llama-cpp-python's sdist
# (vendor/llama.cpp), for the serving benchmark (benchmarks/serving.py) and the remote-mode tests.
#
#   scripts/build_llama_server.sh            # -> build/llama-server/bin/llama-server
#   LLAMA_SERVER_JOBS=4 scripts/build_llama_server.sh
#
# Idempotent: does nothing when the binary is already there (delete build/llama-server to rebuild).
# Needs cmake and a C++ compiler (apt-get install -y cmake build-essential). ~7 min with -j2.
# -DLLAMA_USE_PREBUILT_UI=OFF: otherwise the build downloads the web UI.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${LLAMA_SERVER_JOBS:-2}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="$ROOT/build/llama-server"
BIN="$PREFIX/bin/llama-server"

if [[ -x "$BIN" ]]; then
    echo "llama-server already built: $BIN"
    exit 0
fi

for tool in cmake c++ make; do
    command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install -y cmake build-essential" >&2; exit 1; }
done

WORK="$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

echo "downloading the llama-cpp-python==$VERSION sdist into $WORK"
# --no-binary for this package only: with :all: pip also builds the sdist's build backend
# (scikit-build-core, hatchling, ...) from source just to read its metadata, which takes minutes.
python -m pip download --no-binary llama-cpp-python --no-deps -d "$WORK" "llama-cpp-python==$VERSION"
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
[[ -f "$SRC/CMakeLists.txt" ]] || { echo "no vendor/llama.cpp in the sdist" >&2; exit 1; }

cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
cmake --build "$WORK/build" --target llama-server -j"$JOBS"

mkdir -p "$PREFIX/bin"
cp "$WORK/build/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"   # atomic: a half-copied binary never looks built
echo "built: $BIN"
"$BIN" --version || true
