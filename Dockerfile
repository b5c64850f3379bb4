# The pdserve image: worker, router and operator in one, entrypoint `pdserve`
# (`pdserve worker ...`, `pdserve router ...`, `pdserve operator ...`; the operator's
# Deployments and the Helm chart set the subcommand).
#
#   docker build -t <registry>/pdserve:0.1.0 .
#   helm install pdserve charts/pdserve --set image.repository=<registry>/pdserve
#
# The defaults are the GPU image: CUDA 13 runtime (the nixl extra is nixl-cu13) and torch from
# PyTorch's cu130 index. Both are build arguments so that CI builds this same file on a machine
# without GPUs or PyTorch's index: a Debian base made by mmdebstrap and the CPU torch wheel
# mounted in (.ci/build_image.sh).
ARG BASE_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
ARG TORCH_VERSION=2.13.0
# pip's arguments that say where torch comes from; CI: "--find-links /wheels" (and 2.13.0+cpu).
ARG TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cu130"
ARG EXTRAS=nixl,triton
ARG APP_UID=1000
# A CA bundle for pip behind a TLS-intercepting proxy (CI mounts its machine's): no default, so
# unset unless passed, and as an ARG it is never part of the image's environment.
ARG PIP_CERT

FROM ${BASE_IMAGE} AS python
ARG TORCH_VERSION
ARG TORCH_PIP_ARGS
ARG PIP_CERT

# /cache is the model cache: Hugging Face downloads (hf:// sources) and pdserve's own cache.
# Mount a volume there to keep weights across pod restarts; the image works without one.
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/opt/pdserve \
    PATH=/opt/pdserve/bin:$PATH \
    HF_HOME=/cache/huggingface \
    XDG_CACHE_HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton

# apt versions are whatever the base's release ships (the base tag pins them).
# TORCH_PIP_ARGS is several pip arguments: word splitting is wanted. torch's pin is a variable.
# hadolint ignore=DL3008,DL3013,SC2086
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/pdserve \
 && pip install "torch==${TORCH_VERSION}" ${TORCH_PIP_ARGS}

# The dependencies before the source, as a list read from pyproject.toml in a stage of its own:
# the layer that installs them (hundreds of MB) is keyed by that list alone, so neither a
# source change nor another pyproject.toml edit (a test tool, a package folder) rebuilds it.
FROM python AS requirements
ARG EXTRAS
COPY pyproject.toml /src/
RUN python3 -c 'import sys, tomllib; p = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]; \
extras = [d for e in sys.argv[1].split(",") if e for d in p["optional-dependencies"][e]]; \
print("\n".join(p["dependencies"] + extras))' "${EXTRAS}" > /requirements.txt

# The project as a wheel, in a stage of its own: the final image installs that wheel from a bind
# mount, so it holds one copy of the code (site-packages), never the source tree beside it.
# setuptools (torch's dependency) is already in the venv: no isolated build environment to
# download on every source change.
FROM python AS wheel
WORKDIR /src
COPY pyproject.toml ./
COPY README.md ./
COPY worker worker
COPY router router
COPY operator operator
COPY kernels kernels
COPY bench bench
COPY protocol protocol
COPY cli cli
# hadolint ignore=DL3013
RUN pip wheel --no-deps --no-build-isolation --wheel-dir /dist .

FROM python
ARG APP_UID
ARG PIP_CERT
COPY --from=requirements /requirements.txt /tmp/requirements.txt
# hadolint ignore=DL3013
RUN pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

# The project itself; its dependencies are the layer above. The wheel is copied in, not bind-
# mounted: buildah (podman build) keys a RUN's layer cache on its command, not on what a mount
# from another stage holds, so a mounted wheel of new source would reuse the old install.
COPY --from=wheel /dist /tmp/dist
# hadolint ignore=DL3013
RUN pip install --no-deps /tmp/dist/pdserve-*.whl \
 && rm -rf /tmp/dist \
 && pdserve --help > /dev/null

# Non-root: the chart's and operator's securityContext runs UID 1000 (Ubuntu's own "ubuntu"
# user holds that UID in the CUDA base, so it is renamed rather than duplicated).
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
