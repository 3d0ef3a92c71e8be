# kube-ghost-guard container image.
#
#   docker build -t kube-ghost-guard:0.1.0 .
#
# Reproducible: the base image is pinned by digest (the multi-arch index, so
# linux/amd64 and linux/arm64 both resolve), and every Python package comes
# from a lock with hashes: requirements.lock (runtime, generated from
# pyproject.toml) and requirements-build.lock (the build backend). pip refuses
# any file whose hash is not in the lock (--require-hashes), installs nothing
# the lock does not name (--no-deps), and only prebuilt wheels (no compiler is
# needed or present). docs/INSTALL.md says how to bump the base digest and
# regenerate the locks; tests/repo/test_lockfile.py fails when they disagree
# with pyproject.toml.
#
# Two stages on the same base. The builder installs the locked dependencies
# into the virtualenv /opt/ghost-guard, builds the guard's wheel with the
# locked setuptools (in a throwaway virtualenv) and installs it without
# dependencies. The final stage copies just /opt/ghost-guard: no source tree,
# no pip cache, no build tools. It runs as UID 65532 (non-root; the manifests'
# runAsUser).
#
# Same base in both stages: the virtualenv links to the base's interpreter.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY requirements.lock requirements-build.lock ./
RUN python -m venv /opt/build \
 && /opt/build/bin/pip install --require-hashes --no-deps --only-binary=:all: -r requirements-build.lock \
 && python -m venv /opt/ghost-guard \
 && /opt/ghost-guard/bin/pip install --require-hashes --no-deps --only-binary=:all: -r requirements.lock
COPY pyproject.toml README.md ./
COPY guard ./guard
RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation --wheel-dir /wheels . \
 && /opt/ghost-guard/bin/pip install --no-deps /wheels/*.whl \
 && /opt/ghost-guard/bin/pip check \
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
