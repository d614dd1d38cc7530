# syntax=docker/dockerfile:1
# The kvflow image: one `kvflow` entrypoint for every role (operator, router, gateway, sim).
#
#   docker build -t ghcr.io/you/kvflow:0.1.0 .                       # the default, small image
#   docker build --target kvflow-nixl -t ghcr.io/you/kvflow:0.1.0-nixl .   # + NIXL for P/D KV transfers
#   make image                                                        # buildah, offline base (see Makefile)
#
# BASE_IMAGE must provide python3 (>= 3.11) with the venv module; builder and runtime use the same
# one, so the venv's interpreter link stays valid. `make image` passes a Debian base it makes with
# mmdebstrap. Behind a TLS-intercepting proxy, pass its CA bundle as the build secret `pip-ca`
# (docker build --secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt); it never enters a layer.
ARG BASE_IMAGE=python:3.12-slim-bookworm

FROM ${BASE_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_WARN_SCRIPT_LOCATION=1
# kvflow's venv gets no pip of its own (the runtime needs none); a tool venv installs into it.
RUN python3 -m venv --without-pip /opt/kvflow && python3 -m venv /opt/pip
# A C compiler, in the builder only, for kvflow._native (the loops a request runs through before
# it is routed). Where apt cannot fetch one, pip leaves the module out and numpy does the same work.
RUN if ! command -v cc >/dev/null; then \
      pkgs="gcc libc6-dev"; \
      [ -e "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ] || pkgs="$pkgs python3-dev"; \
      (apt-get update && apt-get install -y --no-install-recommends $pkgs && rm -rf /var/lib/apt/lists/*) >/dev/null 2>&1 \
        || echo "no C compiler: kvflow._native is left out"; \
    fi
# Dependencies first, from pyproject alone: this layer is reused until the dependencies change.
COPY pyproject.toml /src/pyproject.toml
RUN --mount=type=secret,id=pip-ca --mount=type=cache,target=/root/.cache/pip \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    python3 -c 'import tomllib; print("\n".join(tomllib.load(open("/src/pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > /tmp/requirements.txt \
    && /opt/pip/bin/pip --python /opt/kvflow/bin/python install -r /tmp/requirements.txt
# Then kvflow itself (.dockerignore lets in only pyproject, setup.py, README and the package folders;
# pyproject's package-dir maps each component folder to kvflow.<name>).
COPY . /src/
RUN --mount=type=secret,id=pip-ca --mount=type=cache,target=/root/.cache/pip \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    /opt/pip/bin/pip --python /opt/kvflow/bin/python install --no-deps /src \
    && /opt/kvflow/bin/kvflow --version \
    && (/opt/kvflow/bin/python -c 'import kvflow._native' 2>/dev/null || echo "kvflow._native not built: numpy does its work")

# NIXL (with its bundled UCX) for real KV-cache transfers between prefill and decode pods: about
# 220 MB, so only the kvflow-nixl target has it. No deps: its CUDA pins are not needed on CPU.
FROM builder AS nixl-builder
ARG NIXL_VERSION=1.5.1
RUN --mount=type=secret,id=pip-ca --mount=type=cache,target=/root/.cache/pip \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    /opt/pip/bin/pip --python /opt/kvflow/bin/python install --no-deps "nixl-cu12==${NIXL_VERSION}" "nixl==${NIXL_VERSION}"

FROM ${BASE_IMAGE} AS runtime-base
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="kvflow" \
      org.opencontainers.image.description="Kubernetes-native control plane for LLM serving on vLLM: operator, router, gateway, simulator" \
      org.opencontainers.image.source="https://github.com/kvflow/kvflow" \
      org.opencontainers.image.url="https://github.com/kvflow/kvflow" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="kvflow"
# A numeric, non-root user (Kubernetes' runAsNonRoot can only verify numeric ones). Written
# directly: minimal bases have no useradd.
RUN echo "kvflow:x:65532:65532:kvflow:/home/kvflow:/usr/sbin/nologin" >> /etc/passwd \
    && echo "kvflow:x:65532:" >> /etc/group \
    && mkdir -p /home/kvflow && chown 65532:65532 /home/kvflow
ENV PATH=/opt/kvflow/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/kvflow
WORKDIR /home/kvflow

FROM runtime-base AS kvflow-nixl
COPY --from=nixl-builder /opt/kvflow /opt/kvflow
USER 65532:65532
ENTRYPOINT ["kvflow"]
CMD ["--help"]

# The default target (last): the small image.
FROM runtime-base AS kvflow
COPY --from=builder /opt/kvflow /opt/kvflow
USER 65532:65532
ENTRYPOINT ["kvflow"]
CMD ["--help"]
