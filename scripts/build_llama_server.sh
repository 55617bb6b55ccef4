#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` from the llama.cpp sources that PyPI's llama-cpp-python sdist vendors, into a
# cache reused by later runs; prints the binary's path as its last line.
#   scripts/build_llama_server.sh            # CPU only, version pinned below
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 STRATA_CACHE_DIR=~/.cache/strata JOBS=2 scripts/build_llama_server.sh
#   CUDA=1 CUDA_ARCHITECTURES=90 LLAMA_CPP_SRC=.whl/llama.cpp-src.tar.xz scripts/build_llama_server.sh
# Only the llama-server target is built (no Python extension, no other tools). CPU builds are -O1 (OPT=-O3 for
# speed): that binary serves tests on tiny models, where compile time is what counts. CUDA=1 builds the GPU peer
# of `bench peers` at -O3 for the named architectures only (the H200 is 90). LLAMA_CPP_SRC takes the sources
# from a directory or a tarball (scripts/pack_llama_src.sh writes one) instead of the package registry, for a
# machine that has none.
set -euo pipefail

version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
cache_root="${STRATA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/strata}"
cuda="${CUDA:-0}"
suffix=""
[[ "$cuda" == 1 ]] && suffix="-cuda"
dest="$cache_root/llama-server/$version$suffix"
bin="$dest/bin/llama-server"
jobs="${JOBS:-$(nproc)}"
opt="${OPT:-$([[ "$cuda" == 1 ]] && echo -O3 || echo -O1)}"
python="${PYTHON:-python3}"

if [[ -x "$bin" ]] && "$bin" --version >/dev/null 2>&1; then
    echo "cached: $bin" >&2
    echo "$bin"
    exit 0
fi

for tool in cmake "${CXX:-c++}"; do
    command -v "$tool" >/dev/null || { echo "build_llama_server: '$tool' not found (apt-get install cmake g++)" >&2; exit 1; }
done

work="$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
start_s=$(date +%s)

if [[ -n "${LLAMA_CPP_SRC:-}" && -d "$LLAMA_CPP_SRC" ]]; then
    src="$LLAMA_CPP_SRC"
elif [[ -n "${LLAMA_CPP_SRC:-}" ]]; then
    tar -xf "$LLAMA_CPP_SRC" -C "$work"  # a tarball whose top folder is llama.cpp/
    src="$work/llama.cpp"
else
    # The sdist itself, not a wheel: it carries vendor/llama.cpp (pip prepares its metadata first: about a minute).
    "$python" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
    tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work" --wildcards '*/vendor/llama.cpp/*'
    src="$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)"
fi
[[ -f "$src/CMakeLists.txt" ]] || { echo "build_llama_server: no llama.cpp sources at $src" >&2; exit 1; }
backend=(-DGGML_CUDA=OFF)
if [[ "$cuda" == 1 ]]; then
    command -v nvcc >/dev/null || { echo "build_llama_server: CUDA=1 needs nvcc on PATH" >&2; exit 1; }
    backend=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES:-90}")
fi

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$src" -B "$work/build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_FLAGS_RELEASE="$opt -DNDEBUG" -DCMAKE_CXX_FLAGS_RELEASE="$opt -DNDEBUG" \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF \
    "${backend[@]}" -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENMP=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    >"$work/configure.log" 2>&1 || { tail -30 "$work/configure.log" >&2; exit 1; }
cmake --build "$work/build" --target llama-server -j "$jobs" >"$work/build.log" 2>&1 \
  || { tail -40 "$work/build.log" >&2; exit 1; }

mkdir -p "$dest/bin"
cp "$work/build/bin/llama-server" "$bin.tmp"
mv "$bin.tmp" "$bin"
echo "built llama-server $version in $(( $(date +%s) - start_s )) s" >&2
echo "$bin"
