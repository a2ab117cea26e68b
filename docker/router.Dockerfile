# vllm-router in front of kvserve instances (docker/compose.disagg.yaml, compose.replicas.yaml,
# docker/k8s/): prefill/decode disaggregation or load balancing over replicas.
#   docker build -f docker/router.Dockerfile -t kvserve-router docker/
# Arguments after the image name go to `vllm-router` (its defaults listen on 127.0.0.1:30000,
# so always pass --host 0.0.0.0 --port ...). No model, no GPU: the wheel bundles the Rust router.
# The pin matches the test extra in pyproject.toml (tests/test_deploy_manifests.py checks).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN pip install --no-cache-dir vllm-router==0.1.17 \
    && useradd --no-create-home --uid 10002 router

USER 10002:10002
# 8080: the OpenAI API (as the compose files and manifests configure it); 29000: Prometheus
EXPOSE 8080 29000
ENTRYPOINT ["vllm-router"]
