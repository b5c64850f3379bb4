# The pdserve image: worker, router and operator in one, entrypoint `pdserve`
# (`pdserve worker ...`, `pdserve router ...`, `pdserve operator ...`; the operator's
# Deployments and the Helm chart set the subcommand).
#
#   docker build -t <registry>/pdserve:0.1.0 .
#   helm install pdserve charts/pdserve --set image.repository=<registry>/pdserve
#
# CUDA 13 runtime, because the nixl extra is nixl-cu13; torch comes from PyTorch's cu130 index.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG APP_UID=1000

# /cache is the model cache: Hugging Face downloads (hf:// sources) and pdserve's own cache.
# Mount a volume there to keep weights across pod restarts; the image works without one.
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/pdserve \
    PATH=/opt/pdserve/bin:$PATH \
    HF_HOME=/cache/huggingface \
    XDG_CACHE_HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton

# apt versions are whatever the CUDA base's Ubuntu release ships (the base tag pins them).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/pdserve \
 && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY worker worker
COPY router router
COPY operator operator
COPY kernels kernels
COPY bench bench
COPY protocol protocol
COPY cli cli
# The project itself, from the copied source; pyproject.toml bounds its dependencies.
# hadolint ignore=DL3013
RUN pip install ".[nixl,triton]" \
 && pdserve --help > /dev/null

# Non-root: the chart's and operator's securityContext runs UID 1000 (Ubuntu's own "ubuntu"
# user holds that UID in this base, so it is renamed rather than duplicated).
RUN (userdel --remove ubuntu 2>/dev/null || true) \
 && groupadd --gid "${APP_UID}" pdserve \
 && useradd --uid "${APP_UID}" --gid "${APP_UID}" --create-home --home-dir /home/pdserve --shell /usr/sbin/nologin pdserve \
 && mkdir -p /cache \
 && chown -R "${APP_UID}:${APP_UID}" /cache
VOLUME ["/cache"]
USER ${APP_UID}:${APP_UID}
WORKDIR /home/pdserve

ENTRYPOINT ["pdserve"]
CMD ["--help"]
