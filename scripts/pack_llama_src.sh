#!/usr/bin/env bash
# Writes the llama.cpp sources that PyPI's llama-cpp-python sdist vendors, trimmed to what building llama-server
# needs (no docs, models, tests, examples or other GPU backends: about 6 MB instead of 73), as a tarball whose top
# folder is llama.cpp/. For a machine without a package registry (the GPU machine):
#   scripts/pack_llama_src.sh .whl/llama.cpp-src.tar.xz          # then, there:
#   CUDA=1 LLAMA_CPP_SRC=.whl/llama.cpp-src.tar.xz scripts/build_llama_server.sh
# LLAMA_CPP_SDIST=path/to/llama_cpp_python-X.tar.gz uses a downloaded sdist instead of fetching one.
set -euo pipefail

out="${1:?usage: pack_llama_src.sh OUT.tar.xz}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
python="${PYTHON:-python3}"
work="$(mktemp -d "${TMPDIR:-/tmp}/llama-src.XXXXXX")"
trap 'rm -rf "$work"' EXIT

sdist="${LLAMA_CPP_SDIST:-}"
if [[ -z "$sdist" ]]; then
    "$python" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
    sdist="$(echo "$work"/llama_cpp_python-*.tar.gz)"
fi
tar -xzf "$sdist" -C "$work" --wildcards '*/vendor/llama.cpp/*'
vendor="$(echo "$work"/llama_cpp_python-*/vendor)"
excludes=()
for dir in docs models tests benches media gguf-py examples pocs; do excludes+=("--exclude=llama.cpp/$dir"); done
for backend in cann hexagon hip metal musa opencl openvino sycl virtgpu vulkan webgpu zdnn zendnn et; do
    excludes+=("--exclude=llama.cpp/ggml/src/ggml-$backend")
done
mkdir -p "$(dirname "$out")"
tar -cJf "$out.partial" -C "$vendor" "${excludes[@]}" llama.cpp
mv "$out.partial" "$out"
echo "$out"
