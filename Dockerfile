# syntax=docker/dockerfile:1
# The gateway image: the core install plus the `redis` extra, pinned by
# deploy/constraints.txt, on a slim Debian Python, running as a non-root user.
#
#   docker build -t cache-gateway .
#   docker run --rm -p 8080:8080 -e GATEWAY_BACKENDS=http://10.0.0.5:8000,http://10.0.0.6:8000 \
#       -v $PWD/config/gateway.docker.toml:/etc/gateway/gateway.toml:ro cache-gateway
#
# Settings come from outside: a TOML file mounted at /etc/gateway/gateway.toml (required;
# the gateway exits with status 2 naming the problem when it is missing or invalid) and
# GATEWAY_* environment variables (GATEWAY_BACKENDS names the replicas without a file
# listing them). deploy/gateway/gateway.toml is compose's: it names hosts (vllm-0, redis)
# that exist only on compose's network. The listen address is forced to 0.0.0.0 by the
# command below; the port is the file's or GATEWAY_SERVER__PORT (default 8080), and the
# health check reads it the same way.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtualenv at /opt/gateway, dependencies first for layer caching ----
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/gateway
WORKDIR /src
# Every dependency is a pinned wheel (manylinux/musllinux wheels exist for uvloop,
# httptools, orjson, xxhash, aiohttp): no compiler in the image.
COPY deploy/constraints.txt deploy/constraints.txt
RUN /opt/gateway/bin/pip install --only-binary=:all: -r deploy/constraints.txt
COPY pyproject.toml README.md ./
COPY gateway ./gateway
RUN /opt/gateway/bin/pip install --no-deps . \
 && /opt/gateway/bin/pip check \
 && /opt/gateway/bin/pip uninstall -y pip setuptools

# ---- runtime: the virtualenv only ----
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="cache-gateway" \
      org.opencontainers.image.description="Caching-aware OpenAI-compatible gateway for vLLM" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 gateway \
 && useradd --system --uid 10001 --gid gateway --no-create-home --shell /usr/sbin/nologin gateway \
 && mkdir -p /etc/gateway /var/lib/gateway \
 && chown gateway:gateway /var/lib/gateway
COPY --from=build /opt/gateway /opt/gateway
ENV PATH=/opt/gateway/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# usage logs, if [usage] log_path points here
WORKDIR /var/lib/gateway
USER 10001:10001
EXPOSE 8080
# /health answers 200 while the process serves; readiness (a healthy replica) is /ready.
# No curl in a slim image: the venv's Python does the probe, on the port the settings
# name (gateway/healthcheck.py reads the file and GATEWAY_* as `gateway serve` does).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-m", "gateway.healthcheck", "/etc/gateway/gateway.toml"]
ENTRYPOINT ["gateway", "serve"]
CMD ["--config", "/etc/gateway/gateway.toml", "--host", "0.0.0.0"]
