# syntax=docker/dockerfile:1
#
# ztunnel (Python) container image, for the Helm chart in charts/ztunnel.
#
#   docker build -t <registry>/ztunnel:0.1.0 .
#
# The chart runs it as upstream's: `args: [proxy, ztunnel]`, root with NET_ADMIN/SYS_ADMIN/NET_RAW granted by the pod
# spec, readOnlyRootFilesystem with an emptyDir on /tmp. Checked offline by tests/test_packaging.py (hadolint, COPY
# sources, the package the builder installs built from exactly what it copies, ENTRYPOINT/CMD against the console
# script, and as root the console script run with this ENV and the chart's env on a read-only root with a tmpfs on
# /tmp); no Docker engine is needed for the tests.

# Base image, pinned by digest so a rebuild gets the same interpreter and libc. The digest is the multi-platform
# index of `python:3.11-slim` (CPython 3.11.15 on Debian trixie, amd64/arm64/...) as published on Docker Hub on
# 2026-08-05, recorded by docker-library/repo-info (repos/python/remote/3.11-slim.md, commit 2477d553d2fd).
# To move on: `docker buildx imagetools inspect python:3.11-slim` and replace both lines (or pass --build-arg).
ARG PYTHON_IMAGE=python:3.11-slim
ARG PYTHON_DIGEST=sha256:90744cff8f32887f075c47d747a173ff333e9e98801667af93c357fa9f5e28ff

# ---------------------------------------------------------------------------------------------------------------------
# builder: /opt/venv with the pinned dependencies, the package, and its bytecode.
FROM ${PYTHON_IMAGE}@${PYTHON_DIGEST} AS builder

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

# No pip inside the venv: the builder's pip installs into it (--python), so the runtime image carries no installer.
RUN python -m venv --without-pip /opt/venv

WORKDIR /src

# Dependencies first, in their own layer: it is rebuilt only when the lock changes. Exact pins, wheels only (every
# runtime dependency ships manylinux wheels for CPython 3.11; no compiler in the image).
COPY charts/image/requirements.lock ./requirements.lock
RUN python -m pip --python /opt/venv/bin/python install --no-cache-dir --only-binary=:all: -r requirements.lock

# The package itself (PEP 621, setuptools). --no-deps: everything it needs came from the lock, and `pip check`
# fails the build if the lock missed something. .dockerignore keeps ztunnel/testing/, ztunnel/standins/ (the local
# control plane and node agent) and ztunnel/demo.py out of the context: the image carries the proxy and the protos.
COPY pyproject.toml README.md ./
COPY ztunnel ./ztunnel
COPY xds ./xds
RUN python -m pip --python /opt/venv/bin/python install --no-cache-dir --no-deps . \
    && python -m pip --python /opt/venv/bin/python check \
    && /opt/venv/bin/python -m compileall -q -j 0 --invalidation-mode unchecked-hash /opt/venv/lib \
    && /opt/venv/bin/ztunnel version

# ---------------------------------------------------------------------------------------------------------------------
# runtime: the base image plus /opt/venv, nothing else.
FROM ${PYTHON_IMAGE}@${PYTHON_DIGEST} AS runtime

# PYTHONDONTWRITEBYTECODE: the root filesystem is read-only; the bytecode was compiled in the builder with
#   --invalidation-mode unchecked-hash, so it is used as is whatever the files' mtimes after COPY.
# PYTHONUNBUFFERED: log lines reach the container runtime as they are written.
# PYTHONFAULTHANDLER: a fatal signal dumps every thread's Python stack (upstream's chart sets RUST_BACKTRACE=1).
# MALLOC_*: glibc malloc tuned for the data path. Relay buffers grow to 256 KiB and HTTP/2 frames to 1 MiB; with
#   glibc's defaults buffers of that size are mmap()ed and unmapped on every allocation, or the heap top is trimmed
#   and faulted back in. A fixed 4 MiB mmap threshold keeps them on the heap, the 256 MiB trim threshold and 64 MiB
#   top pad stop the trim/refault cycle (+61-65% relay throughput in this project's measurements).
#   MALLOC_ARENA_MAX=2 bounds the per-thread arenas (glibc's default is 8 per core: up to 64 MiB of address space
#   each, and fragmentation that shows up as RSS) for the few helper threads (gRPC, the resolver, the default
#   executor): the event loop does the data-path work on one thread. Revisit if the data path becomes multi-threaded.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONFAULTHANDLER=1 \
    MALLOC_ARENA_MAX=2 \
    MALLOC_MMAP_THRESHOLD_=4194304 \
    MALLOC_TRIM_THRESHOLD_=268435456 \
    MALLOC_TOP_PAD_=67108864

# The official image deletes the standard library's bytecode to save space; with a read-only root filesystem every
# start would recompile asyncio, ssl, json, ... in memory. Compile it once here, skipping what CPython's own
# `make install` skips (deliberately broken test inputs) and the base's site-packages (pip, not used at run time).
RUN python -m compileall -q -j 0 --invalidation-mode unchecked-hash \
        -x 'bad_coding|badsyntax|site-packages|lib2to3/tests/data' /usr/local/lib/python3.11

COPY --from=builder /opt/venv /opt/venv

# ztunnel resolves its defaults relative to the working directory, as upstream does from `/`:
# ./var/run/secrets/istio/root-cert.pem (the istio-ca-root-cert ConfigMap), ./var/run/secrets/tokens/istio-token (the
# projected token) and ./etc/istio/config/mesh. Nothing is written outside /tmp (the local CA directory is only used
# with FAKE_CA=true, which the chart never sets).
WORKDIR /

# No USER: ztunnel needs root with NET_ADMIN, SYS_ADMIN and NET_RAW in in-pod mode; the chart's pod securityContext
# sets runAsUser 0 / runAsGroup 1337 and drops every other capability, as upstream's image and chart do.

# Exec form, so ztunnel is PID 1 and receives SIGTERM itself (it drains, then exits). The chart passes
# `args: [proxy, ztunnel]`, which replaces CMD; the default is the same command.
ENTRYPOINT ["/opt/venv/bin/ztunnel"]
CMD ["proxy", "ztunnel"]
