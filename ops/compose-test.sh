#!/usr/bin/env bash
# ops/compose-test.sh — the compose deployment (docker-compose.yml) built, started, scaled and
# checked end to end, as a user would run it, on a machine that cannot pull images.
#
#   1. docker       docker.io, docker-compose and debootstrap installed (ops/services.sh
#                   --docker-only); a Docker daemon running — one already running is used,
#                   otherwise this script starts `dockerd` and stops it (only it) at the end.
#   2. base image   local/debian:bookworm made with `debootstrap --variant=minbase` from the
#                   Debian mirror apt uses, then `docker import`; kept between runs (built
#                   again only when missing, or with --rebuild-base).
#   3. images       fleet-rabbitmq, fleet-redis, fleet-prometheus (Debian packages, built by
#                   `docker-compose build` from ops/images/) and fleet (ops/Dockerfile, target
#                   `prebuilt`, with the binaries cargo built on this host) — under the names
#                   docker-compose.yml uses. Docker's layer cache keeps unchanged ones.
#   4. up           `docker-compose up -d` under a project name of its own, with an env file
#                   made from ops/fleet.env.example with fresh passwords and API token, and
#                   free host ports; waits until every container is healthy.
#   5. batch 1      1,000 `sleep` tasks published with fleetctl through the published AMQP
#                   port; each must succeed on its first attempt.
#   6. scale        `docker-compose up -d --scale worker=3`; the three `worker` containers
#                   must be registered and active.
#   7. batch 2      1,000 tasks with selector gpu=false (only the `worker` service has
#                   it): each succeeds once, and each of the three containers runs at least
#                   COMPOSE_MIN_SHARE of them (GET /v1/tasks/{id} says which worker ran it).
#   8. prometheus   every scrape target (scheduler, 4 workers, RabbitMQ, Prometheus) up, and
#                   sum(fleet_tasks_completed_total{outcome="succeeded"}) = 2,000.
#   9. drain        COUNT tasks of 200 ms, `docker-compose stop worker` while they run:
#                   every worker container exits 0; `docker-compose start worker`, and all
#                   of them succeed on their first attempt: nothing lost, nothing run twice.
#  10. down         `docker-compose down -v`: no container, network or volume of the project
#                   is left.
#
#   ops/compose-test.sh                  all of the above
#   ops/compose-test.sh --build-only     steps 1-3: the images, for `docker-compose up -d`
#   ops/compose-test.sh --keep           leave the project running at the end (or on failure)
#   ops/compose-test.sh --rebuild-base   make the debootstrap base image again
#
# Environment:
#   FLEET_BIN_DIR       binaries to put in the fleet image (ops/test.sh passes target/debug);
#                       unset: `cargo build` (dev profile), as ops/demo.sh
#   FLEET_BASE_IMAGE    (local/debian:bookworm) base of every image
#   FLEET_IMAGE_TAG     (local) tag of the images
#   DEBIAN_MIRROR       mirror for debootstrap (default: the one in /etc/apt/sources.list*)
#   COMPOSE_COUNT       (1000) tasks per batch
#   COMPOSE_MIN_SHARE   (0.1) least share of batch 2 each of the three workers must run
#   COMPOSE_WAIT        (180) seconds any single wait may take
#
# Runs as root (installs packages, starts dockerd); when not root, through sudo.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="${PATH}:/usr/local/sbin:/usr/sbin:/sbin"
LIB_TAG=compose-test
# shellcheck source=ops/lib.sh
. ops/lib.sh

BUILD_ONLY=0
KEEP=0
REBUILD_BASE=0
while [ $# -gt 0 ]; do
    case "$1" in
    --build-only) BUILD_ONLY=1 ;;
    --keep) KEEP=1 ;;
    --rebuild-base) REBUILD_BASE=1 ;;
    -h | --help)
        script_help
        exit 0
        ;;
    *) die "unknown argument: $1 (try --help)" ;;
    esac
    shift
done

export FLEET_BASE_IMAGE=${FLEET_BASE_IMAGE:-local/debian:bookworm}
export FLEET_IMAGE_TAG=${FLEET_IMAGE_TAG:-local}
COUNT=${COMPOSE_COUNT:-1000}
MIN_SHARE=${COMPOSE_MIN_SHARE:-0.1}
WAIT=${COMPOSE_WAIT:-180}
PY=/usr/bin/python3
[ -x "$PY" ] || PY=python3

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || die "not root and sudo is not installed"
    SUDO=(sudo)
fi

TMP=$(mktemp -d)
DOCKERD_PID=""
PROJECT=""
declare -a TIMES=()
SECONDS=0

# --------------------------------------------------------------------------- clean-up

# The project's leftovers, by label: "KIND ID" lines (containers, networks, volumes).
leftovers() {
    local filter="label=com.docker.compose.project=$PROJECT"
    "${SUDO[@]}" docker ps -aq --filter "$filter" | sed 's/^/container /'
    "${SUDO[@]}" docker network ls -q --filter "$filter" | sed 's/^/network /'
    "${SUDO[@]}" docker volume ls -q --filter "$filter" | sed 's/^/volume /'
}

cleanup() {
    local rc=$?
    set +e
    if [ -n "$PROJECT" ] && [ "$KEEP" -eq 0 ] && [ -n "$(leftovers 2>/dev/null)" ]; then
        if [ "$rc" -ne 0 ]; then
            log "failed: the last log lines of every container"
            dc logs --no-color --tail 40 >&2
        fi
        log "removing project $PROJECT"
        timeout 120 "${SUDO[@]}" env "${COMPOSE_ENV[@]}" docker-compose -p "$PROJECT" down -v -t 10 >/dev/null 2>&1
    elif [ -n "$PROJECT" ] && [ "$KEEP" -eq 1 ]; then
        log "kept project $PROJECT: ${COMPOSE_ENV[*]} docker-compose -p $PROJECT ..."
    fi
    if [ -n "$DOCKERD_PID" ]; then
        if [ "$KEEP" -eq 1 ]; then
            log "kept dockerd (pid $DOCKERD_PID) running for the kept project"
        else
            log "stopping the dockerd this script started (pid $DOCKERD_PID)"
            "${SUDO[@]}" kill -TERM "$DOCKERD_PID" 2>/dev/null
            local deadline=$((SECONDS + 30))
            while "${SUDO[@]}" kill -0 "$DOCKERD_PID" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
                sleep 0.5
            done
            if "${SUDO[@]}" kill -0 "$DOCKERD_PID" 2>/dev/null; then
                warn "dockerd did not stop within 30 s: killing it"
                "${SUDO[@]}" kill -KILL "$DOCKERD_PID" 2>/dev/null
            fi
        fi
    fi
    if [ "$rc" -ne 0 ] && [ -s "$TMP/dockerd.log" ]; then
        show_log_tail "$TMP/dockerd.log" 20
    fi
    if [ "$rc" -ne 0 ]; then
        printf '\n== compose-test FAILED after %ss; the steps so far:\n' "$SECONDS" >&2
        printf '%s\n' "${TIMES[@]}" >&2
        [ -z "$STEP" ] || printf '%-44s %4ss  (failed)\n' "$STEP" "$((SECONDS - STEP_T0))" >&2
    fi
    rm -rf "$TMP"
    exit "$rc"
}
trap cleanup EXIT

# timed NAME COMMAND...: run COMMAND and remember how long it took.
STEP=""
STEP_T0=0
timed() {
    STEP=$1
    STEP_T0=$SECONDS
    shift
    printf '\n== %s\n' "$STEP" >&2
    "$@"
    TIMES+=("$(printf '%-44s %4ss' "$STEP" "$((SECONDS - STEP_T0))")")
    STEP=""
}

COMPOSE_ENV=("FLEET_BASE_IMAGE=$FLEET_BASE_IMAGE" "FLEET_IMAGE_TAG=$FLEET_IMAGE_TAG")
dc() { "${SUDO[@]}" env "${COMPOSE_ENV[@]}" docker-compose -p "$PROJECT" "$@"; }

# ------------------------------------------------------------------------ 1. docker

ensure_daemon() {
    bash ops/services.sh --docker-only
    if timeout 20 "${SUDO[@]}" docker info >/dev/null 2>&1; then
        log "using the Docker daemon that already runs"
        return 0
    fi
    # No iptables rules and no default bridge: the project's own network (a Linux bridge with
    # Docker's DNS) and the published ports (docker-proxy on 127.0.0.1) need neither, and
    # builds use the host's network.
    log "starting dockerd (overlay2, --iptables=false --bridge=none), log $TMP/dockerd.log"
    "${SUDO[@]}" dockerd --storage-driver=overlay2 --iptables=false --ip6tables=false \
        --bridge=none --pidfile "$TMP/dockerd.pid" >"$TMP/dockerd.log" 2>&1 </dev/null &
    local deadline=$((SECONDS + 60))
    until timeout 10 "${SUDO[@]}" docker info >/dev/null 2>&1; do
        if [ -s "$TMP/dockerd.pid" ]; then DOCKERD_PID=$(cat "$TMP/dockerd.pid"); fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            die "dockerd did not answer within 60 s"
        fi
        sleep 1
    done
    DOCKERD_PID=$(cat "$TMP/dockerd.pid")
    log "dockerd up (pid $DOCKERD_PID)"
}

# The images and a running project take about 1.5 GB under Docker's data root.
check_disk() {
    local root free_mb
    root=$("${SUDO[@]}" docker info -f '{{.DockerRootDir}}')
    free_mb=$("${SUDO[@]}" df -Pm "$root" | awk 'NR == 2 { print $4 }')
    [ "${free_mb:-0}" -ge 2048 ] || die "only ${free_mb:-0} MB free under $root (Docker's data root): need 2048 MB"
    log "$free_mb MB free under $root"
}

# ------------------------------------------------------------------- 2. base image

# The Debian mirror apt uses (the first .../debian URL in the sources), or deb.debian.org.
debian_mirror() {
    local url
    url=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
        grep -v '^[[:space:]]*#' | grep -oE 'https?://[^[:space:]]+/debian/?' | head -n1 || true)
    printf '%s\n' "${url:-http://deb.debian.org/debian}"
}

ensure_base_image() {
    if [ "$REBUILD_BASE" -eq 0 ] && "${SUDO[@]}" docker image inspect "$FLEET_BASE_IMAGE" >/dev/null 2>&1; then
        log "base image $FLEET_BASE_IMAGE: present, kept"
        return 0
    fi
    local mirror=${DEBIAN_MIRROR:-$(debian_mirror)} root="$TMP/rootfs"
    local security=${mirror%/debian}/debian-security
    log "base image $FLEET_BASE_IMAGE: debootstrap --variant=minbase bookworm from $mirror"
    "${SUDO[@]}" timeout 900 debootstrap --variant=minbase bookworm "$root" "$mirror" >"$TMP/debootstrap.log" 2>&1 || {
        show_log_tail "$TMP/debootstrap.log"
        die "debootstrap failed"
    }
    # What the official debian:bookworm-slim does too: no docs, man pages or translations in
    # later installs, no package caches kept, services not started by package scripts; and no
    # trace of this host (hostname, resolver). Security updates as on any Debian machine.
    "${SUDO[@]}" bash -euo pipefail -s "$root" "$mirror" "$security" <<'EOF'
root=$1 mirror=$2 security=$3
cd "$root"
printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
    'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' \
    'path-exclude /usr/share/locale/*' 'path-include /usr/share/locale/locale.alias' \
    >etc/dpkg/dpkg.cfg.d/excludes
cat >etc/apt/apt.conf.d/docker-clean <<'CONF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
CONF
printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb %s bookworm-security main\n' \
    "$mirror" "$mirror" "$security" >etc/apt/sources.list
printf '#!/bin/sh\nexit 101\n' >usr/sbin/policy-rc.d
chmod 0755 usr/sbin/policy-rc.d
rm -rf var/cache/apt/archives/*.deb var/cache/apt/*.bin var/lib/apt/lists/* \
    usr/share/doc/* usr/share/man/* usr/share/info/* var/log/*.log etc/hostname
find usr/share/locale -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
: >etc/resolv.conf
EOF
    "${SUDO[@]}" tar -C "$root" -c . | "${SUDO[@]}" docker import - "$FLEET_BASE_IMAGE" >/dev/null
    "${SUDO[@]}" rm -rf "$root"
    log "base image $FLEET_BASE_IMAGE: imported"
}

# ------------------------------------------------------------------------ 3. images

build_service_images() {
    # docker-compose.yml's own build definitions (ops/images/*.Dockerfile, network host).
    PROJECT=${PROJECT:-fleet-build}
    dc build --parallel rabbitmq redis prometheus >"$TMP/build.log" 2>&1 || {
        show_log_tail "$TMP/build.log" 60
        die "docker-compose build failed"
    }
}

build_fleet_image() {
    locate_binaries
    # Only bin/ is the build context (not the repository and its target/); debug sections
    # are dropped, which makes debug binaries a fraction of their size.
    mkdir -p "$TMP/ctx/bin"
    local b
    for b in fleet-scheduler fleet-worker fleetctl; do
        objcopy --strip-debug "$BIN/$b" "$TMP/ctx/bin/$b"
    done
    "${SUDO[@]}" docker build -q --network host -f ops/Dockerfile --target prebuilt \
        --build-arg "RUNTIME_IMAGE=$FLEET_BASE_IMAGE" -t "fleet:$FLEET_IMAGE_TAG" "$TMP/ctx" \
        >"$TMP/build-fleet.log" 2>&1 || {
        show_log_tail "$TMP/build-fleet.log" 60
        die "building fleet:$FLEET_IMAGE_TAG failed"
    }
}

# The images this script makes, derived ones first (the order in which replaced ones can go).
IMAGES=("fleet:$FLEET_IMAGE_TAG" "fleet-rabbitmq:$FLEET_IMAGE_TAG" "fleet-redis:$FLEET_IMAGE_TAG"
    "fleet-prometheus:$FLEET_IMAGE_TAG" "$FLEET_BASE_IMAGE")
declare -A OLD_IDS=()

# remember_images: the ids IMAGES have now, so the ones a rebuild replaces can be removed.
remember_images() {
    local img
    for img in "${IMAGES[@]}"; do
        OLD_IDS[$img]=$("${SUDO[@]}" docker image inspect -f '{{.Id}}' "$img" 2>/dev/null || true)
    done
}

# remove_replaced_images: removes the images a rebuild has replaced (now without a name),
# so that runs do not pile them up; one still in use by a container stays.
remove_replaced_images() {
    local img old new
    for img in "${IMAGES[@]}"; do
        old=${OLD_IDS[$img]:-}
        new=$("${SUDO[@]}" docker image inspect -f '{{.Id}}' "$img" 2>/dev/null || true)
        if [ -n "$old" ] && [ "$old" != "$new" ] &&
            [ -z "$("${SUDO[@]}" docker image inspect -f '{{join .RepoTags ","}}' "$old" 2>/dev/null)" ]; then
            "${SUDO[@]}" docker rmi "$old" >/dev/null 2>&1 && log "removed the replaced image of $img (${old:7:12})"
        fi
    done
    return 0
}

image_sizes() {
    local img
    for img in "$FLEET_BASE_IMAGE" "fleet:$FLEET_IMAGE_TAG" "fleet-rabbitmq:$FLEET_IMAGE_TAG" \
        "fleet-redis:$FLEET_IMAGE_TAG" "fleet-prometheus:$FLEET_IMAGE_TAG"; do
        printf '  %-28s %s MB, user %s\n' "$img" \
            "$(("$("${SUDO[@]}" docker image inspect -f '{{.Size}}' "$img")" / 1000000))" \
            "$("${SUDO[@]}" docker image inspect -f '{{if .Config.User}}{{.Config.User}}{{else}}root{{end}}' "$img")"
    done
}

# --------------------------------------------------------------------------- 4. up

# A fresh env file: the example with new passwords and an API token, the URLs in step.
make_env_file() {
    local pass token
    pass=$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')
    token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
    # The example's API token lines are replaced (whatever their placeholders), then every
    # remaining change-me (the RabbitMQ password, in FLEET_AMQP_URL too) by the new password.
    grep -q '^FLEET_API_TOKENS=' ops/fleet.env.example || die "ops/fleet.env.example sets no FLEET_API_TOKENS"
    grep -q '^RABBITMQ_DEFAULT_PASS=change-me$' ops/fleet.env.example || die "ops/fleet.env.example: RABBITMQ_DEFAULT_PASS is not the change-me placeholder"
    {
        grep -v -e '^FLEET_API_TOKENS=' -e '^FLEET_API_TOKEN=' ops/fleet.env.example | sed -e "s/change-me/$pass/g"
        printf 'FLEET_API_TOKENS=%s admin\nFLEET_API_TOKEN=%s\n' "$token" "$token"
    } >"$TMP/fleet.env"
    chmod 0600 "$TMP/fleet.env"
    AMQP_USER=$(sed -n 's/^RABBITMQ_DEFAULT_USER=//p' "$TMP/fleet.env")
    AMQP_PASS=$pass
    export FLEET_API_TOKEN=$token
}

# containers SERVICE: the ids of the service's containers.
containers() { dc ps -q "$1"; }

# wait_healthy: every container of the project running and, where it has a healthcheck, healthy.
wait_healthy() {
    local deadline=$((SECONDS + WAIT)) id state pending
    while :; do
        pending=""
        for id in $(dc ps -q); do
            state=$("${SUDO[@]}" docker inspect -f '{{.Name}} {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}' "$id")
            case "$state" in
            *" running healthy" | *" running none") ;;
            *) pending="$pending ${state// /:}" ;;
            esac
        done
        [ -z "$pending" ] && return 0
        if [ "$SECONDS" -ge "$deadline" ]; then
            die "not healthy within ${WAIT}s:$pending"
        fi
        sleep 2
    done
}

up() {
    make_env_file
    PROJECT=$(random_namespace fleetci | tr -d -)
    AMQP_PORT=$(free_port)
    API_PORT=$(free_port)
    PROM_PORT=$(free_port)
    UI_PORT=$(free_port)
    COMPOSE_ENV+=("FLEET_ENV_FILE=$TMP/fleet.env" "FLEET_AMQP_PORT=$AMQP_PORT"
        "FLEET_SCHEDULER_PORT=$API_PORT" "FLEET_PROMETHEUS_PORT=$PROM_PORT"
        "FLEET_RABBITMQ_UI_PORT=$UI_PORT")
    log "project $PROJECT: AMQP 127.0.0.1:$AMQP_PORT, API 127.0.0.1:$API_PORT, Prometheus 127.0.0.1:$PROM_PORT"
    dc up -d --no-build >&2
    wait_healthy
    dc ps >&2
}

# -------------------------------------------------------------------- 5-9. the fleet

# fleetctl from the host build, publishing through the published AMQP port (the URL goes
# in the environment, not on the command line where `ps` shows it).
fleetctl() {
    env FLEET_AMQP_URL="amqp://$AMQP_USER:$AMQP_PASS@127.0.0.1:$AMQP_PORT/%2f" \
        FLEET_NAMESPACE=fleet FLEET_API_URL="http://127.0.0.1:$API_PORT" "$BIN/fleetctl" "$@"
}

# publish PREFIX PAYLOAD [FLEETCTL SUBMIT ARGS...]: COUNT sleep tasks PREFIX-1..PREFIX-COUNT.
publish() {
    local prefix=$1 payload=$2 out
    shift 2
    out=$(fleetctl submit --kind sleep --payload "$payload" --count "$COUNT" --id "$prefix" "$@")
    [ "$out" = "accepted=$COUNT refused=0" ] || die "fleetctl submit: $out (wanted accepted=$COUNT refused=0)"
    log "published $COUNT tasks $prefix-1..$COUNT through 127.0.0.1:$AMQP_PORT"
}

check() { "$PY" ops/compose-check.py "$@"; }

hostnames() {
    local id
    for id in $(containers "$1"); do
        "${SUDO[@]}" docker inspect -f '{{.Config.Hostname}}' "$id"
    done | paste -sd, -
}

batch1() {
    publish "b1-$PROJECT" '{"ms":20}'
    check tasks --api "http://127.0.0.1:$API_PORT" --prefix "b1-$PROJECT" --count "$COUNT" --timeout "$WAIT"
}

scale() {
    dc up -d --no-build --scale worker=3 >&2
    wait_healthy
    local n
    n=$(containers worker | wc -l)
    [ "$n" -eq 3 ] || die "--scale worker=3 gave $n worker containers"
    WORKER_HOSTS=$(hostnames worker)
    check workers --api "http://127.0.0.1:$API_PORT" --hosts "$WORKER_HOSTS,$(hostnames worker-gpu)" --timeout "$WAIT"
}

batch2() {
    publish "b2-$PROJECT" '{"ms":20}' --labels gpu=false
    check tasks --api "http://127.0.0.1:$API_PORT" --prefix "b2-$PROJECT" --count "$COUNT" \
        --hosts "$WORKER_HOSTS" --min-share "$MIN_SHARE" --timeout "$WAIT"
}

prometheus() {
    # scheduler + 3 worker + 1 worker-gpu + RabbitMQ + Prometheus itself
    check prometheus --url "http://127.0.0.1:$PROM_PORT" --targets 7 --completed "$((2 * COUNT))" \
        --jobs fleet-scheduler,fleet-worker,rabbitmq,prometheus --timeout "$WAIT"
}

drain() {
    local id code ids states errors
    # Each of the 3 workers runs 8 at a time: 1,000 tasks of 200 ms keep them busy ~8 s.
    publish "b3-$PROJECT" '{"ms":200}' --labels gpu=false
    ids=$(containers worker)
    log "docker-compose stop worker (SIGTERM: drain, then exit)"
    dc stop worker >&2
    states=$(check states --api "http://127.0.0.1:$API_PORT" --prefix "b3-$PROJECT" --count "$COUNT")
    log "batch 3 when the workers had stopped: $states"
    case " $states " in
    *" succeeded=$COUNT "*) die "the whole batch had run before the workers stopped: nothing was drained" ;;
    esac
    for id in $ids; do
        code=$("${SUDO[@]}" docker inspect -f '{{.Name}} {{.State.Status}} exit={{.State.ExitCode}}' "$id")
        log "  $code"
        case "$code" in *" exited exit=0") ;; *) die "a worker did not drain cleanly: $code" ;; esac
        # Known: lapin sometimes logs `Connection error: invalid connection state: Closed` at
        # ERROR after the worker has closed its connection; reported, not failed on here.
        errors=$("${SUDO[@]}" docker logs "$id" 2>&1 | grep '"level":"ERROR"' || true)
        [ -z "$errors" ] || warn "worker ${id:0:12} logged while draining: $errors"
    done
    dc start worker >&2
    wait_healthy
    check tasks --api "http://127.0.0.1:$API_PORT" --prefix "b3-$PROJECT" --count "$COUNT" \
        --hosts "$WORKER_HOSTS" --timeout "$WAIT"
}

down() {
    dc down -v -t 30 >&2
    local left
    left=$(leftovers)
    [ -z "$left" ] || die "docker-compose down -v left: $(echo "$left" | paste -sd' ' -)"
    log "nothing of project $PROJECT is left (containers, networks, volumes)"
    PROJECT=""
}

# ---------------------------------------------------------------------------- main

start=$SECONDS
timed "docker daemon" ensure_daemon
check_disk
remember_images
timed "base image" ensure_base_image
timed "images: rabbitmq, redis, prometheus" build_service_images
timed "image: fleet (host binaries)" build_fleet_image
PROJECT=""
remove_replaced_images
log "images:"
image_sizes
if [ "$BUILD_ONLY" -eq 1 ]; then
    log "images built; run: FLEET_BASE_IMAGE=$FLEET_BASE_IMAGE docker-compose up -d"
    exit 0
fi
timed "up -d, all healthy" up
timed "batch 1: $COUNT tasks" batch1
timed "scale worker=3" scale
timed "batch 2: $COUNT tasks on the 3 workers" batch2
timed "prometheus: targets up, completed count" prometheus
timed "drain: stop worker mid-batch, start again" drain
if [ "$KEEP" -eq 1 ]; then
    log "--keep: project $PROJECT left running"
else
    timed "down -v, nothing left" down
fi
printf '\n== compose-test passed in %ss\n' "$((SECONDS - start))"
printf '%s\n' "${TIMES[@]}"
