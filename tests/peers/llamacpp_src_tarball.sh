#!/usr/bin/env bash
# Makes the llama.cpp source tarball that scripts/gpu-evidence.sh builds on the GPU machine (which
# has nvcc and CMake but no network), for the peer figures of docs/perf.md: llama-cpp-python's
# sdist, its vendored llama.cpp tree without docs, models, tests, examples, the web UI and the
# non-CUDA GPU backends (~4.5 MB as .tar.xz, under the device's 64 MiB carry limit).
#
#   bash tests/peers/llamacpp_src_tarball.sh [OUT.tar.xz] [llama-cpp-python version]
#
# Defaults: .wtcuda/llama.cpp.tar.xz (git-ignored), version 0.3.36 (the one docs/perf.md measured).
# The sdist comes through pip (`pip download --no-binary :all:`), which checks the index's hash.
# pip prepares the sdist's metadata before it keeps the file, which needs the package's build
# backend (scikit-build-core, which also looks for a CMake >= 3.21 on the path, though it stops
# before configuring): both are installed here and used without build isolation.
set -euo pipefail
out=${1:-.wtcuda/llama.cpp.tar.xz}
ver=${2:-0.3.36}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip install -q scikit-build-core cmake
python3 -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
  "llama-cpp-python==$ver" -d "$tmp"
tar xzf "$tmp/llama_cpp_python-$ver.tar.gz" -C "$tmp"
src="$tmp/llama_cpp_python-$ver/vendor"
mkdir -p "$(dirname "$out")"
tar cJf "$out" -C "$src" \
  --exclude=llama.cpp/docs --exclude=llama.cpp/models --exclude=llama.cpp/media \
  --exclude=llama.cpp/benches --exclude=llama.cpp/tests --exclude=llama.cpp/examples \
  --exclude=llama.cpp/tools/ui --exclude=llama.cpp/gguf-py --exclude=llama.cpp/conversion \
  --exclude=llama.cpp/ggml/src/ggml-sycl --exclude=llama.cpp/ggml/src/ggml-vulkan \
  --exclude=llama.cpp/ggml/src/ggml-opencl --exclude=llama.cpp/ggml/src/ggml-hexagon \
  --exclude=llama.cpp/ggml/src/ggml-metal --exclude=llama.cpp/ggml/src/ggml-et \
  llama.cpp
ls -la "$out"
