# Container images for strata. Needs BuildKit: the default builder since Docker 23; Docker 20.10 builds this file with
# DOCKER_BUILDKIT=1 (checked with Debian 12's docker.io, see scripts/docker-build-offline.sh).
#
#   docker build --target worker      -t strata/stage-worker:0.1.0 .   # CUDA runtime, stage-worker + strata CLI
#   docker build --target coordinator -t strata/coordinator:0.1.0  .   # Debian slim, coordinator + strata CLI
#   docker build --target cli         -t strata/cli:0.1.0          .   # Debian slim, strata CLI only
#
# BuildKit only builds the stages a target needs: `coordinator` and `cli` never touch CUDA; `worker` runs the
# CUDA build. Both images run as uid/gid 10001, the ids the Helm chart's securityContext uses.
#
# Base images are pinned by tag and digest. The digests were taken from public build logs and Dockerfiles, not
# resolved against a registry from here (this project's machines cannot reach one); before a release, confirm each
# with `docker buildx imagetools inspect <image:tag>` and update it here.
ARG RUST_IMAGE=rust:1.95-bookworm@sha256:6258907abe69656e41cd992e0b705cdcfabcbbe3db374f92ed2d47121282d4a1
ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04@sha256:6a0e31b59e70890446f2c17356d6efc0d54260090a8c63d6ca7c2ad049db95d2
ARG DEBIAN_IMAGE=debian:bookworm-slim@sha256:3783cc01769c7b2b1b83a5c5ad96c815348e28ed7da68e2e3687004faa906251

# ---------------------------------------------------------------------------------------------------------------
FROM ${RUST_IMAGE} AS rust-base
# libprotobuf-dev holds the well-known types (google/protobuf/descriptor.proto, struct.proto) that etcd-client's
# build script imports; protobuf-compiler only recommends it, and --no-install-recommends leaves it out.
RUN apt-get update \
 && apt-get install -y --no-install-recommends protobuf-compiler libprotobuf-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# rust-toolchain.toml pins the channel and also lists rustfmt and clippy. The rust image installs rustup's minimal
# profile (rustc, cargo, rust-std), so with that file in force every cargo RUN below would first download the two
# components from static.rust-lang.org (and fail where that host is unreachable). The build needs neither: cargo
# runs with RUSTUP_TOOLCHAIN set to the file's channel, which pins the same toolchain without the component list.

# CPU build: the coordinator and the CLI, with no CUDA feature anywhere in the feature graph.
FROM rust-base AS build-cpu
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target,id=strata-target-cpu \
    set -eu; \
    RUSTUP_TOOLCHAIN="$(sed -n 's/^channel *= *"\(.*\)"$/\1/p' rust-toolchain.toml)"; export RUSTUP_TOOLCHAIN; \
    test -n "${RUSTUP_TOOLCHAIN}"; \
    cargo build --release --locked -p strata-cli -p strata-coordinator \
 && mkdir -p /out \
 && cp target/release/strata target/release/coordinator /out/

# CUDA build of the stage worker. The kernels (kernels/*.cu) are compiled to PTX by NVRTC when the worker starts
# (see kernels/nvrtc_compile.py), so the build needs no GPU and, by default, no CUDA compiler. If the cuda feature
# ever compiles kernels at build time, build with `--build-arg CUDA_NVCC=1`: that installs nvcc from NVIDIA's
# Debian 12 repository, and CUDA_COMPUTE_CAP names the target architecture (90 = Hopper, 89 = Ada, 80 = Ampere).
FROM rust-base AS build-cuda
ARG CUDA_NVCC=0
ARG CUDA_APT_VERSION=13-0
ARG CUDA_COMPUTE_CAP=90
ARG TARGETARCH
RUN set -eux; \
    if [ "${CUDA_NVCC}" = "1" ]; then \
      case "${TARGETARCH:-amd64}" in amd64) repo_arch=x86_64 ;; arm64) repo_arch=sbsa ;; \
        *) echo "unsupported arch ${TARGETARCH}"; exit 1 ;; esac; \
      apt-get update; \
      apt-get install -y --no-install-recommends curl; \
      curl -fsSLo /tmp/cuda-keyring.deb \
        "https://developer.download.nvidia.com/compute/cuda/repos/debian12/${repo_arch}/cuda-keyring_1.1-1_all.deb"; \
      dpkg -i /tmp/cuda-keyring.deb; rm /tmp/cuda-keyring.deb; \
      apt-get update; \
      apt-get install -y --no-install-recommends \
        "cuda-nvcc-${CUDA_APT_VERSION}" "cuda-cudart-dev-${CUDA_APT_VERSION}"; \
      rm -rf /var/lib/apt/lists/*; \
    fi
ENV PATH=/usr/local/cuda/bin:${PATH} \
    CUDA_HOME=/usr/local/cuda \
    CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP}
# Sources last, so the toolchain layers above stay cached across code changes.
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target,id=strata-target-cuda \
    set -eu; \
    RUSTUP_TOOLCHAIN="$(sed -n 's/^channel *= *"\(.*\)"$/\1/p' rust-toolchain.toml)"; export RUSTUP_TOOLCHAIN; \
    test -n "${RUSTUP_TOOLCHAIN}"; \
    cargo build --release --locked -p strata-cli -p strata-coordinator -p strata-stage-worker \
      --features strata-stage-worker/cuda \
 && mkdir -p /out \
 && cp target/release/strata target/release/stage-worker /out/

# ---------------------------------------------------------------------------------------------------------------
# Stage worker: CUDA 13.0 runtime libraries (cudart, cuBLAS, NVRTC); the driver comes from the host through the
# NVIDIA container runtime. Runs CPU-only too (`--device cpu`).
FROM ${CUDA_RUNTIME_IMAGE} AS worker
# NVRTC compiles the kernels at worker start, and they include cuda_fp16.h / cuda_bf16.h: the runtime image ships
# libnvrtc but not those headers, so add them from the CUDA apt repository the base image already configures.
# Set WORKER_APT_PACKAGES="" if the worker takes the headers NVRTC bundles instead.
ARG WORKER_APT_PACKAGES="cuda-cudart-dev-13-0"
RUN set -eux; \
    if [ -n "${WORKER_APT_PACKAGES}" ]; then \
      apt-get update; \
      apt-get install -y --no-install-recommends ${WORKER_APT_PACKAGES}; \
      rm -rf /var/lib/apt/lists/*; \
    fi
RUN groupadd --system --gid 10001 strata \
 && useradd --system --uid 10001 --gid strata --home-dir /var/lib/strata --create-home --shell /usr/sbin/nologin strata \
 && mkdir -p /models \
 && chown strata:strata /models
COPY --from=build-cuda --chown=root:root --chmod=0755 /out/stage-worker /out/strata /usr/local/bin/
ENV CUDA_HOME=/usr/local/cuda \
    CUDA_PATH=/usr/local/cuda \
    STRATA_LISTEN=0.0.0.0:50061 \
    STRATA_MODEL=/models/model \
    STRATA_DEVICE=cuda:0 \
    STRATA_HEALTH_PORT=50061 \
    STRATA_LOG=info
USER 10001:10001
WORKDIR /var/lib/strata
EXPOSE 50061
# No grpc_health_probe: the check is that the stage port accepts a TCP connection (bash's /dev/tcp).
# Kubernetes ignores HEALTHCHECK and uses the chart's probes instead.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/${STRATA_HEALTH_PORT}"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["stage-worker"]

# ---------------------------------------------------------------------------------------------------------------
FROM ${DEBIAN_IMAGE} AS slim-base
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 strata \
 && useradd --system --uid 10001 --gid strata --home-dir /var/lib/strata --create-home --shell /usr/sbin/nologin strata

# The strata CLI alone (`strata client generate`, `strata nodes list|drain|cordon`).
FROM slim-base AS cli
COPY --from=build-cpu --chown=root:root --chmod=0755 /out/strata /usr/local/bin/
USER 10001:10001
WORKDIR /var/lib/strata
ENTRYPOINT ["strata"]

# Coordinator (default target): OpenAI-compatible HTTP API + gRPC. Ships the CLI and curl for `helm test`.
FROM slim-base AS coordinator
COPY --from=build-cpu --chown=root:root --chmod=0755 /out/coordinator /out/strata /usr/local/bin/
RUN mkdir -p /models && chown strata:strata /models
ENV STRATA_GRPC=0.0.0.0:50051 \
    STRATA_HTTP=0.0.0.0:8080 \
    STRATA_MODEL=/models/model \
    STRATA_HEALTH_URL=http://127.0.0.1:8080/health \
    STRATA_LOG=info
USER 10001:10001
WORKDIR /var/lib/strata
EXPOSE 50051 8080
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD ["sh", "-c", "curl -fsS --max-time 4 \"$STRATA_HEALTH_URL\" >/dev/null"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["coordinator"]
