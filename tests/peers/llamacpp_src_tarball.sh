#!/usr/bin/env bash
# Makes the llama.cpp source tarball that tests/gpu/h200_peers_run.sh builds on the GPU machine
# (which has nvcc and CMake but no network): llama-cpp-python's sdist, its vendored llama.cpp
# tree without docs, models, tests, examples, the web UI and the non-CUDA GPU backends (~4.5 MB
# as .tar.xz, under the device's 64 MiB carry limit).
#
#   bash tests/peers/llamacpp_src_tarball.sh [OUT.tar.xz] [llama-cpp-python version]
#
# Defaults: .wtcuda/llama.cpp.tar.xz (git-ignored), version 0.3.36 (the one round 13 measured).
set -euo pipefail
out=${1:-.wtcuda/llama.cpp.tar.xz}
ver=${2:-0.3.36}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The sdist straight from PyPI's simple index (pip download would first build the package's
# metadata), checked against the index's sha256.
python3 - "$ver" "$tmp" <<'PY'
import hashlib, re, sys, urllib.request
ver, d = sys.argv[1], sys.argv[2]
index = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-python/", timeout=60).read().decode()
url = next(u for u in re.findall(r'href="([^"]+)"', index) if f"llama_cpp_python-{ver}.tar.gz#" in u)
url, sha = url.split("#sha256=")
urllib.request.urlretrieve(url, f"{d}/sdist.tar.gz")
got = hashlib.sha256(open(f"{d}/sdist.tar.gz", "rb").read()).hexdigest()
sys.exit(0 if got == sha else f"sha256 mismatch: {got} against the index's {sha}")
PY
tar xzf "$tmp"/sdist.tar.gz -C "$tmp"
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
