# vLLM's router (vllm-router from PyPI, a Rust router behind a Python launcher) for
# deploy/kubernetes: docker build -t kiln-router:0.1.17 -f deploy/docker/router.Dockerfile .
# On Debian bookworm's Python 3.11 in a virtual environment; RUNTIME_IMAGE names another
# bookworm base (scripts/image/check.sh passes one made offline with debootstrap).
ARG RUNTIME_IMAGE=debian:bookworm-slim
FROM ${RUNTIME_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
    && python3 -m venv /opt/router \
    && /opt/router/bin/pip install --no-cache-dir vllm-router==0.1.17 \
    && useradd --system --uid 10001 --user-group router
ENV PATH=/opt/router/bin:$PATH
USER 10001:10001
EXPOSE 8000 29000
ENTRYPOINT ["vllm-router"]
