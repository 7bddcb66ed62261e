# vLLM's router (vllm-router from PyPI, a Rust router behind a Python launcher) for
# deploy/kubernetes: docker build -t kiln-router:0.1.17 -f deploy/docker/router.Dockerfile .
FROM python:3.11-slim
RUN pip install --no-cache-dir vllm-router==0.1.17 \
    && useradd --system --uid 10001 --user-group router
USER 10001:10001
EXPOSE 8000 29000
ENTRYPOINT ["vllm-router"]
