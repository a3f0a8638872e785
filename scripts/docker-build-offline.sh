#!/usr/bin/env bash
# Build the Dockerfile's three targets (worker, coordinator, cli) on a machine that cannot reach any container
# registry, on locally made STAND-IN base images, then smoke-run the images. A green run says the Dockerfile's
# stages, COPYs, users, entrypoints and HEALTHCHECKs work and that the binaries run in them; it does NOT say that
# the pinned base images (the ARG defaults, which this script never changes) build or behave the same.
#
# What stands in for what:
#   debian:bookworm-slim@sha256:...   local/debian:bookworm-slim: `debootstrap --variant=minbase bookworm` from the
#                                     apt mirror, trimmed like the slim image (no docs, man pages or locales; apt
#                                     sources as deb822 with bookworm-updates and bookworm-security), `docker import`ed.
#   rust:1.95-bookworm@sha256:...     local/rust:1.95-bookworm: that Debian plus part of buildpack-deps (gcc, g++, make,
#                                     libc6-dev, pkg-config, libssl-dev, git, curl, ...; not imagemagick, mercurial,
#                                     subversion or most -dev libraries) plus THIS HOST's rustup toolchain 1.95.0 cut to
#                                     rustup's minimal profile (rustc, cargo, rust-std), as the official image installs
#                                     it, under /usr/local/rustup and /usr/local/cargo with RUSTUP_HOME, CARGO_HOME and
#                                     PATH set as there. Plus the host's /usr/local/share/ca-certificates/*.crt
#                                     (EXTRA_CA_DIR), for machines that reach crates.io through a TLS-intercepting proxy.
#   nvidia/cuda:13.0.2-runtime-ubuntu24.04@sha256:...
#                                     nothing faithful: the worker target is built FROM the Debian stand-in with
#                                     WORKER_APT_PACKAGES="" (the CUDA apt repository is unreachable). That exercises the
#                                     CUDA *build* (the cuda feature builds without CUDA: cudarc loads it at run time)
#                                     and the worker image's user, entrypoint and HEALTHCHECK on the CPU device; it does
#                                     not exercise the CUDA runtime image, the headers NVRTC needs, or a GPU.
#   quay.io/coreos/etcd (chart)       local/etcd:3.4-bookworm: the Debian stand-in plus Debian's etcd-server 3.4, only
#                                     for the smoke test's coordinator + worker cluster.
#
# Smoke tests (all containers use --network host, on ports 23790, 25051, 25061, 26051, 26080, 28080):
#   - each image: `id` is 10001:10001, the entrypoint answers --version and --help;
#   - cli image: `strata local --model random:tiny` (a whole cluster in one process) answers /health and a
#     /v1/completions request;
#   - etcd + coordinator image + worker image (--device cpu): both containers' HEALTHCHECKs report healthy, and the
#     coordinator answers /live, /v1/models and a /v1/completions request served by the worker container;
#   - the cli, coordinator and worker containers run as the chart runs them: --read-only with a /tmp tmpfs,
#     --cap-drop ALL, no-new-privileges;
#   - the worker with --device cuda:0 on a machine without an NVIDIA driver fails with an error, not a crash.
#
# Needs: a running Docker daemon with BuildKit (Docker >= 23 with buildx, or Docker 20.10 with DOCKER_BUILDKIT=1:
# Debian 12's docker.io works), debootstrap, curl, an x86_64 host whose rustup (RUSTUP_HOME, CARGO_HOME) has the
# toolchain rust-toolchain.toml names (1.95.0), and access to the Debian mirror and crates.io. Builds use
# `--network host`, so a daemon started with
# `--bridge=none --iptables=false` is enough. On the machine this was written on the daemon ran as
#   setsid nohup nice -n 15 dockerd --storage-driver=overlay2 --iptables=false --bridge=none >dockerd.log 2>&1 &
# and the client was Debian's /usr/bin/docker 20.10 (DOCKER=/usr/bin/docker), as the docker 28 CLI found there had
# no buildx plugin.
#
# Usage:  scripts/docker-build-offline.sh [all|bases|build|smoke]      (default: all)
# Env:    DOCKER (docker client, default docker), WORK (scratch, default /var/tmp/strata-docker; rootfs and
#         contexts go there, never into the repo), MIRROR (default http://deb.debian.org/debian), REBUILD_BASES=1
#         (remake the stand-ins even if they exist), TAG (image tag, default 0.1.0), EXTRA_CA_DIR (default
#         /usr/local/share/ca-certificates; empty: none), DEBIAN_IMG, RUST_IMG, ETCD_IMG (stand-in names).
# Leaves behind: the images local/debian, local/rust, local/etcd and strata-local/{stage-worker,coordinator,cli},
# and BuildKit's cache. Clean up with `docker system prune -af && docker builder prune -af` (removes ALL images).
set -euo pipefail

cd "$(dirname "$0")/.."
repo="$(pwd)"
DOCKER="${DOCKER:-docker}"
WORK="${WORK:-/var/tmp/strata-docker}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
TAG="${TAG:-0.1.0}"
EXTRA_CA_DIR="${EXTRA_CA_DIR-/usr/local/share/ca-certificates}"
RUSTUP_HOME_HOST="${RUSTUP_HOME:-$HOME/.rustup}"
CARGO_HOME_HOST="${CARGO_HOME:-$HOME/.cargo}"
TOOLCHAIN="$(sed -n 's/^channel *= *"\(.*\)"$/\1/p' rust-toolchain.toml)"
DEBIAN_IMG="${DEBIAN_IMG:-local/debian:bookworm-slim}"
RUST_IMG="${RUST_IMG:-local/rust:${TOOLCHAIN%.*}-bookworm}"
ETCD_IMG="${ETCD_IMG:-local/etcd:3.4-bookworm}"
WORKER_IMG="strata-local/stage-worker:${TAG}"
COORD_IMG="strata-local/coordinator:${TAG}"
CLI_IMG="strata-local/cli:${TAG}"
mkdir -p "$WORK/logs"
summary="$WORK/logs/summary.txt"

log() { printf '== %s\n' "$*" | tee -a "$summary" >&2; }
die() { printf 'docker-build-offline: %s\n' "$*" >&2; exit 1; }
have_image() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

# docker build with BuildKit: buildx when the client has it, else the 20.10-era DOCKER_BUILDKIT=1 path.
dbuild() {
  if "$DOCKER" buildx version >/dev/null 2>&1; then
    "$DOCKER" buildx build --load --progress plain --network host "$@"
  else
    local v; v="$("$DOCKER" version --format '{{.Client.Version}}')"
    [ "${v%%.*}" -lt 23 ] || die "docker client $v has no buildx plugin, and BuildKit needs it from 23 on (set DOCKER=)"
    DOCKER_BUILDKIT=1 "$DOCKER" build --progress plain --network host "$@"
  fi
}

make_debian() {
  if have_image "$DEBIAN_IMG" && [ "${REBUILD_BASES:-0}" != 1 ]; then return; fi
  command -v debootstrap >/dev/null || die "debootstrap not installed (apt-get install debootstrap)"
  local r="$WORK/rootfs-bookworm"
  rm -rf "$r"
  log "debootstrap --variant=minbase bookworm from $MIRROR"
  debootstrap --variant=minbase bookworm "$r" "$MIRROR" >"$WORK/logs/debootstrap.log" 2>&1
  # Trim and configure it like debian:bookworm-slim.
  rm -f "$r/etc/apt/sources.list"
  cat >"$r/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${MIRROR%/debian}/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  cat >"$r/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  echo 'Acquire::Languages "none";' >"$r/etc/apt/apt.conf.d/docker-no-languages"
  echo 'Apt::AutoRemove::SuggestsImportant "false";' >"$r/etc/apt/apt.conf.d/docker-autoremove-suggests"
  cat >"$r/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
  rm -rf "$r"/var/cache/apt/archives/*.deb "$r"/var/cache/apt/*.bin "$r"/var/lib/apt/lists/* "$r"/tmp/* \
    "$r"/var/log/*.log "$r"/var/log/apt/*
  find "$r/usr/share/doc" -mindepth 2 ! -name copyright ! -type d -delete
  find "$r/usr/share/doc" -mindepth 1 -type d -empty -delete
  rm -rf "$r"/usr/share/man/* "$r"/usr/share/info/*
  find "$r/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
  : >"$r/etc/resolv.conf"
  tar --numeric-owner -C "$r" -c . | "$DOCKER" import --change 'CMD ["bash"]' - "$DEBIAN_IMG" >/dev/null
  rm -rf "$r"
}

make_rust() {
  if have_image "$RUST_IMG" && [ "${REBUILD_BASES:-0}" != 1 ]; then return; fi
  local tc="${TOOLCHAIN}-x86_64-unknown-linux-gnu" src c="$WORK/rust-ctx"
  src="$RUSTUP_HOME_HOST/toolchains/$tc"
  [ -d "$src" ] || die "no toolchain $tc under $RUSTUP_HOME_HOST/toolchains (rustup toolchain install $TOOLCHAIN)"
  "$src/bin/rustc" --version | grep -q "^rustc $TOOLCHAIN " || die "$src is not rustc $TOOLCHAIN"
  log "rust stand-in from $src (cut to rustup's minimal profile)"
  rm -rf "$c"; mkdir -p "$c/rustup/toolchains" "$c/cargo/bin" "$c/extra-ca"
  cp -aL "$src" "$c/rustup/toolchains/$tc"
  printf 'version = "12"\ndefault_toolchain = "%s"\nprofile = "minimal"\n\n[overrides]\n' "$tc" >"$c/rustup/settings.toml"
  cp "$CARGO_HOME_HOST/bin/rustup" "$c/cargo/bin/rustup"
  local b
  for b in cargo cargo-clippy cargo-fmt cargo-miri clippy-driver rls rust-analyzer rust-gdb rust-gdbgui rust-lldb \
    rustc rustdoc rustfmt; do ln "$c/cargo/bin/rustup" "$c/cargo/bin/$b"; done
  local extra
  extra="$(RUSTUP_HOME="$c/rustup" CARGO_HOME="$c/cargo" "$c/cargo/bin/rustup" component list --installed \
    --toolchain "$tc" | sed -n 's/-x86_64-unknown-linux-gnu$//p' | grep -vx 'rustc\|cargo\|rust-std' || true)"
  # shellcheck disable=SC2086 # one component per word
  [ -z "$extra" ] || RUSTUP_HOME="$c/rustup" CARGO_HOME="$c/cargo" "$c/cargo/bin/rustup" component remove \
    --toolchain "$tc" $extra
  chmod -R a+w "$c/rustup" "$c/cargo"   # as the official image does
  if [ -n "$EXTRA_CA_DIR" ] && compgen -G "$EXTRA_CA_DIR/*.crt" >/dev/null; then cp "$EXTRA_CA_DIR"/*.crt "$c/extra-ca/"; fi
  cat >"$c/Dockerfile" <<EOF
# Stand-in for rust:${TOOLCHAIN%.*}-bookworm (buildpack-deps:bookworm + rustup, minimal profile). Local only.
FROM $DEBIAN_IMG
RUN set -eux; apt-get update; \\
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \\
      ca-certificates curl wget netbase gnupg git openssh-client procps \\
      autoconf automake bzip2 dpkg-dev file g++ gcc libc6-dev libssl-dev libtool make patch pkg-config \\
      unzip xz-utils zlib1g-dev; \\
    rm -rf /var/lib/apt/lists/*
ENV RUSTUP_HOME=/usr/local/rustup \\
    CARGO_HOME=/usr/local/cargo \\
    PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    RUST_VERSION=$TOOLCHAIN
COPY rustup /usr/local/rustup
COPY cargo /usr/local/cargo
RUN rustup --version && cargo --version && rustc --version
# Extra CAs of the build machine (a TLS-intercepting egress proxy, say). Not in the official image.
COPY extra-ca/ /usr/local/share/ca-certificates/
RUN update-ca-certificates
CMD ["bash"]
EOF
  dbuild -t "$RUST_IMG" "$c" >"$WORK/logs/rust-standin.log" 2>&1 || die "rust stand-in failed: $WORK/logs/rust-standin.log"
  rm -rf "$c"
}

make_etcd() {
  if have_image "$ETCD_IMG" && [ "${REBUILD_BASES:-0}" != 1 ]; then return; fi
  local c="$WORK/etcd-ctx"
  rm -rf "$c"; mkdir -p "$c"
  cat >"$c/Dockerfile" <<EOF
FROM $DEBIAN_IMG
RUN apt-get update && apt-get install -y --no-install-recommends etcd-server && rm -rf /var/lib/apt/lists/*
ENTRYPOINT ["etcd"]
EOF
  dbuild -t "$ETCD_IMG" "$c" >"$WORK/logs/etcd-standin.log" 2>&1 || die "etcd stand-in failed: $WORK/logs/etcd-standin.log"
  rm -rf "$c"
}

build_targets() {
  local t img start
  for t in cli coordinator worker; do
    case $t in cli) img=$CLI_IMG ;; coordinator) img=$COORD_IMG ;; worker) img=$WORKER_IMG ;; esac
    log "docker build --target $t -t $img (log: $WORK/logs/build-$t.log)"
    start=$(date +%s)
    dbuild --target "$t" -t "$img" \
      --build-arg RUST_IMAGE="$RUST_IMG" \
      --build-arg DEBIAN_IMAGE="$DEBIAN_IMG" \
      --build-arg CUDA_RUNTIME_IMAGE="$DEBIAN_IMG" \
      --build-arg WORKER_APT_PACKAGES="" \
      "$repo" >"$WORK/logs/build-$t.log" 2>&1 || die "target $t failed: $WORK/logs/build-$t.log"
    log "target $t: $(( $(date +%s) - start )) s, image $("$DOCKER" image inspect --format '{{.Size}}' "$img") bytes"
  done
}

# --- smoke tests -------------------------------------------------------------------------------------------------
containers=()
# As the Helm chart runs them: read-only root filesystem with /tmp writable, no capabilities, no privilege gain.
chart_like=(--read-only --tmpfs /tmp --cap-drop ALL --security-opt no-new-privileges)
cleanup() { local c; for c in "${containers[@]}"; do "$DOCKER" rm -f "$c" >/dev/null 2>&1 || true; done; }
trap cleanup EXIT
run_bg() { local name=$1; shift; "$DOCKER" rm -f "$name" >/dev/null 2>&1 || true; containers+=("$name")
  "$DOCKER" run -d --name "$name" --network host "$@" >/dev/null; }
wait_http() { local url=$1 _; for _ in $(seq 1 120); do curl -fsS --max-time 2 "$url" >/dev/null 2>&1 && return 0; sleep 1; done
  return 1; }
wait_healthy() { local c=$1 s="" _; for _ in $(seq 1 60); do
    s="$("$DOCKER" inspect --format '{{.State.Health.Status}}' "$c")"; [ "$s" = healthy ] && return 0
    [ "$s" = unhealthy ] && break; sleep 5; done
  "$DOCKER" inspect --format '{{json .State.Health}}' "$c" >&2; return 1; }
# random:tiny has no tokenizer, so the prompt is token ids; the check is that 8 tokens come back.
complete() { local r; r="$(curl -fsS --max-time 120 "$1/v1/completions" -H 'content-type: application/json' \
  -d '{"model":"'"$2"'","prompt":[1,2,3],"max_tokens":8}')" || return 1
  grep -q '"completion_tokens":8' <<<"$r" || { echo "unexpected completion: $r" >&2; return 1; }; printf '%s\n' "$r"; }

smoke() {
  local img out
  for img in "$CLI_IMG:strata" "$COORD_IMG:coordinator" "$WORKER_IMG:stage-worker"; do
    local name=${img##*:} image=${img%:*}
    out="$("$DOCKER" run --rm --entrypoint id "$image")"
    [ "$out" = "uid=10001(strata) gid=10001(strata) groups=10001(strata)" ] || die "$image: id says $out"
    "$DOCKER" run --rm "$image" --version | tee -a "$summary"
    "$DOCKER" run --rm "$image" --help >/dev/null
    "$DOCKER" run --rm --entrypoint strata "$image" --version >/dev/null
    log "$image: runs as 10001:10001, $name --version/--help ok, HEALTHCHECK $("$DOCKER" inspect \
      --format '{{with index .Config "Healthcheck"}}{{json .Test}}{{else}}none{{end}}' "$image")"
  done

  log "cli image: strata local --model random:tiny"
  run_bg strata-smoke-local "${chart_like[@]}" "$CLI_IMG" local --model random:tiny --stages 2 --grpc 127.0.0.1:26051 --http 127.0.0.1:26080
  wait_http http://127.0.0.1:26080/health || { "$DOCKER" logs strata-smoke-local >&2; die "strata local: no /health"; }
  out="$(curl -fsS http://127.0.0.1:26080/v1/models)"; log "strata local /v1/models: $out"
  local model; model="$(sed -n 's/.*"id":"\([^"]*\)".*/\1/p' <<<"$out")"
  out="$(complete http://127.0.0.1:26080 "$model")" || die "no completion from strata local"
  log "strata local /v1/completions: $out"
  "$DOCKER" rm -f strata-smoke-local >/dev/null

  log "etcd + coordinator image + worker image (cpu)"
  run_bg strata-smoke-etcd "$ETCD_IMG" --data-dir /tmp/etcd --listen-client-urls http://127.0.0.1:23790 \
    --advertise-client-urls http://127.0.0.1:23790 --listen-peer-urls http://127.0.0.1:23791
  wait_http http://127.0.0.1:23790/health || { "$DOCKER" logs strata-smoke-etcd >&2; die "etcd did not start"; }
  run_bg strata-smoke-coordinator "${chart_like[@]}" -e STRATA_ETCD=http://127.0.0.1:23790 -e STRATA_MODEL=random:tiny \
    -e STRATA_GRPC=127.0.0.1:25051 -e STRATA_HTTP=127.0.0.1:28080 -e STRATA_HEALTH_URL=http://127.0.0.1:28080/health \
    "$COORD_IMG"
  run_bg strata-smoke-worker "${chart_like[@]}" -e STRATA_ETCD=http://127.0.0.1:23790 -e STRATA_MODEL=random:tiny -e STRATA_DEVICE=cpu \
    -e STRATA_LISTEN=127.0.0.1:25061 -e STRATA_ADVERTISE=127.0.0.1:25061 -e STRATA_NODE_ID=worker-0 \
    -e STRATA_HEALTH_PORT=25061 "$WORKER_IMG"
  wait_healthy strata-smoke-worker || { "$DOCKER" logs strata-smoke-worker >&2; die "worker never healthy"; }
  log "worker container: HEALTHCHECK healthy"
  wait_healthy strata-smoke-coordinator || { "$DOCKER" logs strata-smoke-coordinator >&2; die "coordinator never healthy"; }
  log "coordinator container: HEALTHCHECK healthy"
  curl -fsS http://127.0.0.1:28080/live >/dev/null || die "coordinator: no /live"
  out="$(curl -fsS http://127.0.0.1:28080/v1/models)"; log "coordinator /live ok; /v1/models: $out"
  model="$(sed -n 's/.*"id":"\([^"]*\)".*/\1/p' <<<"$out")"
  out="$(complete http://127.0.0.1:28080 "$model")" || die "no completion from the coordinator"
  log "coordinator /v1/completions: $out"
  cleanup; containers=()
# As the Helm chart runs them: read-only root filesystem with /tmp writable, no capabilities, no privilege gain.
chart_like=(--read-only --tmpfs /tmp --cap-drop ALL --security-opt no-new-privileges)

  log "worker image with --device cuda:0 and no NVIDIA driver (expected: an error exit)"
  local rc=0
  out="$("$DOCKER" run --rm --network host -e STRATA_MODEL=random:tiny "$WORKER_IMG" --node-id n --layers 0..4 \
    --listen 127.0.0.1:25062 2>&1)" || rc=$?
  if [ "$rc" -eq 0 ] || [ "$rc" -ge 128 ] || grep -q panicked <<<"$out"; then
    die "worker on cuda:0 without a driver: exit $rc: $out"
  fi
  log "exit $rc: $(tail -n 3 <<<"$out")"
}

case "${1:-all}" in
  bases) make_debian; make_rust; make_etcd ;;
  build) build_targets ;;
  smoke) make_etcd; smoke ;;
  all) make_debian; make_rust; make_etcd; build_targets; smoke ;;
  *) die "usage: $0 [all|bases|build|smoke]" ;;
esac
"$DOCKER" images --format '{{.Repository}}:{{.Tag}}\t{{.Size}}' | grep -E '^(local|strata-local)/' | tee -a "$summary"
