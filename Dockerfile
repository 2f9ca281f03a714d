# syntax=docker/dockerfile:1
# Two images from one file:
#   docker build --target operator -t megafleet/operator .   (slim: no torch)
#   docker build --target engine   -t megafleet/engine .     (CUDA base, torch, the engine)

FROM python:3.12-slim AS operator
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY engine ./engine
COPY dev ./dev
RUN pip install . && rm -rf /src \
    && python -c "import shutil, megafleet_dev, pathlib; shutil.rmtree(pathlib.Path(megafleet_dev.__file__).parent)"
RUN useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin megafleet
USER 65532:65532
WORKDIR /
ENTRYPOINT ["megafleet"]
CMD ["operator"]

FROM nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04 AS engine
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/megafleet
ENV PATH=/opt/megafleet/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY engine ./engine
COPY dev ./dev
RUN pip install '.[engine,megatron]' && rm -rf /src \
    && python -c "import shutil, megafleet_dev, pathlib; shutil.rmtree(pathlib.Path(megafleet_dev.__file__).parent)"
RUN useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin megafleet
USER 65532:65532
WORKDIR /
ENTRYPOINT ["megafleet"]
