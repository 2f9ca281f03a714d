# syntax=docker/dockerfile:1
# Two images from one file:
#   docker build --target operator -t megafleet/operator .   (slim: no torch; ENTRYPOINT megafleet)
#   docker build --target engine   -t megafleet/engine .     (CUDA base, torch, megatron-core; ENTRYPOINT megafleet-engine)
# Both run as the non-root user 65532:65532 (the uid/gid the chart and the engine pods set) with a
# read-only root filesystem: HOME and caches point at /tmp, an emptyDir in every pod.
# tests/unit/test_dockerfile.py checks stages, entrypoints against [project.scripts], and no torch here.

FROM python:3.12-slim AS operator
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HOME=/tmp
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY operator ./operator
COPY engine ./engine
COPY dev ./dev
# The base dependencies only (kopf, lightkube, pydantic, httpx, ...): no extras, so no torch. The dev
# tooling and the engine package are removed: the operator imports neither (import-linter contracts).
RUN pip install . && rm -rf /src \
    && python -c "import importlib.util as u, pathlib as p, shutil; \
[shutil.rmtree(p.Path(u.find_spec(m).origin).parent) for m in ('megafleet_dev', 'megafleet_engine')]"
RUN groupadd --gid 65532 megafleet \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin megafleet
USER 65532:65532
WORKDIR /tmp
ENTRYPOINT ["megafleet"]
CMD ["operator"]

FROM nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04 AS engine
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DEBIAN_FRONTEND=noninteractive HOME=/tmp HF_HOME=/tmp/huggingface TRITON_CACHE_DIR=/tmp/triton
# Ubuntu 24.04's python3 is 3.12, which megatron-core 0.19 needs.
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/megafleet
ENV PATH=/opt/megafleet/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY operator ./operator
COPY engine ./engine
COPY dev ./dev
RUN pip install '.[engine,megatron]' && rm -rf /src \
    && python -c "import shutil, megafleet_dev, pathlib; shutil.rmtree(pathlib.Path(megafleet_dev.__file__).parent)"
RUN groupadd --gid 65532 megafleet \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin megafleet
USER 65532:65532
WORKDIR /tmp
# The operator's pods run `megafleet-engine` with the fleet's settings in MEGAFLEET_* variables.
ENTRYPOINT ["megafleet-engine"]
