# syntax=docker/dockerfile:1
# Two images from one file:
#   docker build --target operator -t megafleet/operator .   (slim: no torch; ENTRYPOINT megafleet)
#   docker build --target engine   -t megafleet/engine .     (CUDA base, torch, megatron-core; ENTRYPOINT megafleet-engine)
# Both run as the non-root user 65532:65532 (the uid/gid the chart and the engine pods set) with a
# read-only root filesystem: HOME and caches point at /tmp, an emptyDir in every pod.
# The bases are build arguments: real users keep the public ones; `megafleet dev images` builds the
# same targets with buildah from a Debian base made locally with mmdebstrap (no registry needed).
# Each image installs into a venv at /opt/megafleet, so any base with python3 (>= 3.11) and venv works.
# The dependencies come first, in layers keyed by pyproject.toml and docker/deps.py alone, so a source
# change rebuilds only the small layer that installs the project itself. The engine's ~6 GB of
# dependencies are resolved once and installed in four layers of 0.5-2.2 GB (docker/deps.py): a
# builder needs about three times a layer's size at once to commit it.
# tests/unit/test_dockerfile.py checks stages, entrypoints against [project.scripts], and no torch here;
# tests/realnode/test_images.py builds both and runs their entrypoints in containers.
ARG OPERATOR_BASE=python:3.12-slim
ARG ENGINE_BASE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

FROM ${OPERATOR_BASE} AS operator
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HOME=/tmp
RUN python3 -m venv /opt/megafleet
ENV PATH=/opt/megafleet/bin:$PATH
WORKDIR /src
COPY pyproject.toml docker/deps.py ./
# The base dependencies only (kopf, lightkube, pydantic, httpx, ...): no extras, so no torch.
RUN python3 deps.py requirements pyproject.toml > /tmp/requirements.txt && pip install -r /tmp/requirements.txt
COPY README.md ./
COPY protocol ./protocol
COPY operator ./operator
COPY engine ./engine
COPY dev ./dev
# The dev tooling and the engine package are removed: the operator imports neither (import-linter contracts).
RUN pip install . && rm -rf /src /tmp/requirements.txt \
    && python -c "import importlib.util as u, pathlib as p, shutil; \
[shutil.rmtree(p.Path(u.find_spec(m).origin).parent) for m in ('megafleet_dev', 'megafleet_engine')]"
RUN groupadd --gid 65532 megafleet \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin megafleet
USER 65532:65532
WORKDIR /tmp
ENTRYPOINT ["megafleet"]
CMD ["operator"]

FROM ${ENGINE_BASE} AS engine
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DEBIAN_FRONTEND=noninteractive HOME=/tmp XDG_CACHE_HOME=/tmp/.cache HF_HOME=/tmp/huggingface \
    TRITON_CACHE_DIR=/tmp/triton TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor
# Ubuntu 24.04's python3 is 3.12, which megatron-core 0.19 needs (on an older Python the megatron
# extra installs nothing, by its marker). A base that already has python3 and venv skips apt.
RUN (python3 -c "import venv, ensurepip" 2>/dev/null || (apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv && rm -rf /var/lib/apt/lists/*)) \
    && python3 -m venv /opt/megafleet
ENV PATH=/opt/megafleet/bin:$PATH
WORKDIR /src
COPY pyproject.toml docker/deps.py ./
# One resolution, pinned per group in pins.json, then one layer per group (the order of deps.GROUPS).
RUN python3 deps.py resolve pyproject.toml pins.json engine megatron
RUN python3 deps.py install pins.json cuda-comm
RUN python3 deps.py install pins.json cuda
RUN python3 deps.py install pins.json torch
RUN python3 deps.py install pins.json rest
COPY README.md ./
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
