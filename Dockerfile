# kube-ghost-guard container image.
#
#   docker build -t kube-ghost-guard:0.1.0 .
#
# Two stages on the same pinned base. The builder turns the source into a
# wheel and installs it, with its dependencies as prebuilt wheels only (no
# compiler is needed or present), into the virtualenv /opt/ghost-guard. The
# final stage copies just that virtualenv: no source tree, no pip cache, no
# build tools. It runs as UID 65532 (non-root; the manifests' runAsUser).
#
# Same base in both stages: the virtualenv links to the base's interpreter.
# Override for a newer patch release with --build-arg PYTHON_IMAGE=...
ARG PYTHON_IMAGE=python:3.11.9-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY guard ./guard
RUN python -m pip wheel --no-deps --wheel-dir /wheels . \
 && python -m venv /opt/ghost-guard \
 && /opt/ghost-guard/bin/pip install --only-binary=:all: /wheels/*.whl \
 && /opt/ghost-guard/bin/ghost-guard --version

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kube-ghost-guard" \
      org.opencontainers.image.description="kube-scheduler extender that rejects ghost Pods served by a stale apiserver watch cache" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/ghost-guard/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=builder /opt/ghost-guard /opt/ghost-guard
USER 65532:65532
EXPOSE 8443
# GET /healthz on the guard's own port. TLS without verification (it is the
# container's own loopback); when the port requires a client certificate
# (--client-ca), set GHOST_GUARD_PROBE_CERT and GHOST_GUARD_PROBE_KEY to the
# monitoring one (monitoring.crt: the probes answer only that role), as the
# Kubernetes Deployment does for the same one-liner in its exec probes. For
# `serve --insecure-http` set GHOST_GUARD_PROBE_URL=http://127.0.0.1:8443/healthz.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os,ssl,sys,urllib.request as u; c=ssl._create_unverified_context(); k=os.environ.get('GHOST_GUARD_PROBE_CERT'); k and c.load_cert_chain(k, os.environ['GHOST_GUARD_PROBE_KEY']); u.urlopen(sys.argv[1] if len(sys.argv) > 1 else os.environ.get('GHOST_GUARD_PROBE_URL', 'https://127.0.0.1:8443/healthz'), context=c, timeout=4)"]
ENTRYPOINT ["ghost-guard"]
CMD ["serve"]
