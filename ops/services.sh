#!/usr/bin/env bash
# ops/services.sh — make sure the local services the fleet needs are installed and running.
#
# Idempotent: installs what is missing (Debian packages through apt-get), starts what is
# down, and leaves alone what already runs. Always: curl, and faketime (libfaketime, for the
# clock-skew test). Every wait is bounded; a service that cannot be
# brought up ends the script with a non-zero status and a message that says why.
#
#   ops/services.sh                 Redis + RabbitMQ installed and running (default), and
#                                   python3-pika + python3-mypy for the Python client's tests
#   ops/services.sh --demo          only what ops/demo.sh needs: Redis + RabbitMQ (and curl),
#                                   none of the tests' extras (faketime, pika, mypy)
#   ops/services.sh --tools         the same as the default, plus the check tools: promtool (package
#                                   prometheus), docker-compose and shellcheck
#   ops/services.sh --tools-only    only the check tools; leaves the services alone
#   ops/services.sh --browser       the same as the default, plus what the console's browser test
#                                   needs: chromium, node, npm and tests/ui's playwright-core
#   ops/services.sh --docker-only   only what ops/compose-test.sh needs: the Docker daemon and
#                                   CLI (docker.io), docker-compose, debootstrap, objcopy
#                                   (binutils); leaves the services alone
#   ops/services.sh --help
#
# Environment:
#   REDIS_PORT          (6379)  port checked / started for Redis on 127.0.0.1
#   RABBITMQ_NODE_PORT  (5672)  AMQP port checked on 127.0.0.1 (RabbitMQ honours it too)
#   SERVICES_REDIS_WAIT (30)    seconds to wait for Redis to answer PONG after starting it
#   SERVICES_RABBITMQ_WAIT (180) seconds to wait for RabbitMQ to finish booting
#   RABBITMQ_RESTART    (unset) 1: a running broker whose open-file limit is too small (or
#                               whose status cannot be read) is stopped and started again
#                               with RABBITMQ_NOFILE; also under CI=true. ops/test.sh sets it.
#   RABBITMQ_NOFILE     (65536) open-file limit (ulimit -n) RabbitMQ is started with; the hard
#                               limit when that is lower. Each quorum queue holds files open
#                               and fleet declares 25 queues per namespace and 4 per group
#                               (docs/scaling.md): at the default 1024 (a 927-handle cache) a
#                               broker with ~335 queues wedged every new connection. Below
#                               RABBITMQ_NOFILE_MIN (4096) the script stops with an error.
#   SERVICES_APT_LOCK_WAIT (300) seconds apt-get waits for the dpkg lock
set -euo pipefail

# rabbitmqctl, rabbitmq-server and friends live in sbin, which a non-root PATH may lack.
export PATH="${PATH}:/usr/local/sbin:/usr/sbin:/sbin"

REDIS_HOST=127.0.0.1
REDIS_PORT="${REDIS_PORT:-6379}"
AMQP_HOST=127.0.0.1
AMQP_PORT="${RABBITMQ_NODE_PORT:-5672}"
REDIS_WAIT="${SERVICES_REDIS_WAIT:-30}"
RABBITMQ_WAIT="${SERVICES_RABBITMQ_WAIT:-180}"
APT_LOCK_WAIT="${SERVICES_APT_LOCK_WAIT:-300}"
RABBITMQ_NOFILE="${RABBITMQ_NOFILE:-65536}"
RABBITMQ_NOFILE_MIN="${RABBITMQ_NOFILE_MIN:-4096}"

log() { printf '[services] %s\n' "$*" >&2; }
warn() { printf '[services] WARNING: %s\n' "$*" >&2; }
die() {
    printf '[services] ERROR: %s\n' "$*" >&2
    exit 1
}

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

# Run a command as root: directly when we are root, through sudo otherwise.
as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root for: $* (not root and sudo is not installed)"
    fi
}

have() { command -v "$1" >/dev/null 2>&1; }

APT_UPDATED=0
apt_install() {
    have apt-get || die "apt-get not found: install $* by hand (this script knows Debian/Ubuntu only)"
    if [ "$APT_UPDATED" -eq 0 ]; then
        log "apt-get update"
        as_root env DEBIAN_FRONTEND=noninteractive \
            apt-get -o DPkg::Lock::Timeout="$APT_LOCK_WAIT" update -qq ||
            die "apt-get update failed"
        APT_UPDATED=1
    fi
    log "apt-get install -y $*"
    as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get -o DPkg::Lock::Timeout="$APT_LOCK_WAIT" install -y -qq --no-install-recommends "$@" ||
        die "apt-get install $* failed"
}

# ensure_cmd BINARY PACKAGE...: install PACKAGE(s) when BINARY is not on PATH.
ensure_cmd() {
    local bin=$1
    shift
    if have "$bin"; then
        return 0
    fi
    log "$bin not found: installing $*"
    apt_install "$@"
    have "$bin" || die "$bin still not found after installing $*"
}

# tcp_open HOST PORT: true when something accepts TCP connections there (bounded to 2 s).
tcp_open() {
    # shellcheck disable=SC2016 # expanded by the inner bash
    timeout 2 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$1" "$2" >/dev/null 2>&1
}

# ---------------------------------------------------------------------------- Redis

redis_up() {
    [ "$(timeout 5 redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" ping 2>/dev/null)" = "PONG" ]
}

ensure_redis() {
    ensure_cmd redis-server redis-server
    ensure_cmd redis-cli redis-tools
    if redis_up; then
        log "redis: up on $REDIS_HOST:$REDIS_PORT"
        return 0
    fi
    if tcp_open "$REDIS_HOST" "$REDIS_PORT"; then
        die "redis: port $REDIS_PORT is open but does not answer PING with PONG (another program, or a password?)"
    fi
    log "redis: down; starting redis-server on $REDIS_HOST:$REDIS_PORT (no persistence)"
    # As root the daemon runs as root, like any process this script starts; the data dir
    # is irrelevant because nothing is saved (--save "" --appendonly no).
    (cd /tmp && redis-server --daemonize yes --bind "$REDIS_HOST" --port "$REDIS_PORT" \
        --save "" --appendonly no) >&2 ||
        die "redis: redis-server failed to start"
    local deadline=$((SECONDS + REDIS_WAIT))
    until redis_up; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            die "redis: started but no PONG from $REDIS_HOST:$REDIS_PORT within ${REDIS_WAIT}s"
        fi
        sleep 0.5
    done
    log "redis: up on $REDIS_HOST:$REDIS_PORT"
}

# ---------------------------------------------------------------------------- RabbitMQ

# rmqctl SECONDS ARGS...: rabbitmqctl ARGS, killed after SECONDS. rabbitmqctl must run as
# root or as the rabbitmq user (the Debian wrapper switches to rabbitmq when called as root,
# so the Erlang cookie matches).
rmqctl() {
    local secs=$1
    shift
    if [ "$(id -u)" -eq 0 ] || [ "$(id -un)" = rabbitmq ]; then
        timeout "$secs" rabbitmqctl "$@"
    else
        as_root timeout "$secs" rabbitmqctl "$@"
    fi
}

rabbitmq_up() {
    # The AMQP listener opens late in the boot, so an open port means a usable broker; the
    # status call covers a broker listening elsewhere than 127.0.0.1.
    tcp_open "$AMQP_HOST" "$AMQP_PORT" && return 0
    rmqctl 30 -q status >/dev/null 2>&1
}

# Fleet's broker settings that rabbitmq.conf cannot hold (ops/rabbitmq/advanced.config: the
# dead-letter re-send after 5 s instead of 180 s, issue 37 item 1), installed before a start
# when the host has no advanced.config of its own (an existing one is left alone: say so).
install_rabbitmq_advanced_config() {
    local src target=/etc/rabbitmq/advanced.config
    src="$(dirname "$0")/rabbitmq/advanced.config"
    [ -f "$src" ] || return 0
    if [ -e "$target" ]; then
        if ! grep -q dead_letter_worker_publisher_confirm_timeout "$target"; then
            log "rabbitmq: $target exists without dead_letter_worker_publisher_confirm_timeout; add the setting from $src (the TTL delay tiers of fleet versions before issue 37 otherwise wait up to 180 s after a node loss)"
        fi
        return 0
    fi
    log "rabbitmq: installing $target (from $src)"
    if [ "$(id -u)" -eq 0 ]; then
        install -m 0644 "$src" "$target"
    else
        as_root install -m 0644 "$src" "$target"
    fi
}

ensure_rabbitmq() {
    ensure_cmd rabbitmq-server rabbitmq-server
    ensure_cmd rabbitmqctl rabbitmq-server
    if rabbitmq_up; then
        log "rabbitmq: up (AMQP $AMQP_HOST:$AMQP_PORT)"
        if [ "${RABBITMQ_RESTART:-}" != 1 ] && [ "${CI:-}" != true ]; then
            check_rabbitmq_nofile warn || true
            return 0
        fi
        # With RABBITMQ_RESTART=1 (ops/test.sh sets it: the suite wedges a broker left with
        # the usual 1,024) or CI=true, a broker whose status cannot be read (a node that lost
        # its database) is restarted too.
        if [ -n "$(rabbitmq_fd_limit)" ] && check_rabbitmq_nofile warn; then
            return 0
        fi
        # CI owns its machine's broker: one started with a small open-file limit wedges
        # mid-suite (new connections hang once the handle cache is full), so it is stopped
        # cleanly here and started again below with the limit.
        log "rabbitmq: stopping the broker to start it again with open-file limit $RABBITMQ_NOFILE (RABBITMQ_RESTART=1 or CI=true)"
        rmqctl 120 -q stop >/dev/null 2>&1 || log "rabbitmq: 'rabbitmqctl stop' failed; waiting for the node to go"
        local until=$((SECONDS + 60))
        while tcp_open "$AMQP_HOST" "$AMQP_PORT"; do
            [ "$SECONDS" -lt "$until" ] || die "rabbitmq: still listening 60 s after 'rabbitmqctl stop'"
            sleep 1
        done
    fi
    install_rabbitmq_advanced_config
    log "rabbitmq: down; starting rabbitmq-server -detached (open-file limit $RABBITMQ_NOFILE)"
    # The limit is set in the shell that execs the server: RABBITMQ_NOFILE, or the hard limit
    # if that is lower and cannot be raised (ops/nofile-exec.sh, which the test harness starts
    # its private nodes with too). As root, the server is started as the rabbitmq user with
    # setpriv, not through the Debian wrapper's `su rabbitmq`: su's PAM session sets the soft
    # limit back to 1,024 (seen on the CI machine: the broker ran out of file handles mid-suite
    # and Mnesia died with emfile), while setpriv keeps the limits it is given.
    local nofile_exec
    nofile_exec="$(cd "$(dirname "$0")" && pwd)/nofile-exec.sh"
    if [ "$(id -u)" -eq 0 ] && command -v setpriv >/dev/null 2>&1 && id -u rabbitmq >/dev/null 2>&1; then
        (cd /var/lib/rabbitmq && sh "$nofile_exec" "$RABBITMQ_NOFILE" setpriv --reuid=rabbitmq --regid=rabbitmq --init-groups \
            env HOME=/var/lib/rabbitmq rabbitmq-server -detached) >&2 || die "rabbitmq: rabbitmq-server -detached failed"
    elif [ "$(id -u)" -eq 0 ] || [ "$(id -un)" = rabbitmq ]; then
        sh "$nofile_exec" "$RABBITMQ_NOFILE" rabbitmq-server -detached >&2 || die "rabbitmq: rabbitmq-server -detached failed"
    else
        as_root sh "$nofile_exec" "$RABBITMQ_NOFILE" rabbitmq-server -detached >&2 || die "rabbitmq: rabbitmq-server -detached failed"
    fi
    # -detached returns before the node exists; await_startup fails fast while the node is
    # not reachable yet, so retry it until the deadline.
    local deadline=$((SECONDS + RABBITMQ_WAIT)) left step
    while :; do
        left=$((deadline - SECONDS))
        if [ "$left" -le 0 ]; then
            die "rabbitmq: not up within ${RABBITMQ_WAIT}s (see /var/log/rabbitmq/ and 'rabbitmqctl status')"
        fi
        step=$((left < 60 ? left : 60))
        if rmqctl "$step" -q -t "$step" await_startup >/dev/null 2>&1; then
            break
        fi
        sleep 2
    done
    # The application is up; the listener follows within a moment.
    deadline=$((SECONDS + 30))
    until tcp_open "$AMQP_HOST" "$AMQP_PORT"; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "rabbitmq: node started but nothing listens on $AMQP_HOST:$AMQP_PORT"
            log "rabbitmq: (a listener bound to another address? check /etc/rabbitmq/rabbitmq.conf)"
            die "rabbitmq: AMQP port $AMQP_PORT not reachable"
        fi
        sleep 1
    done
    log "rabbitmq: up (AMQP $AMQP_HOST:$AMQP_PORT)"
    check_rabbitmq_nofile die
}

# The broker's file-descriptor limit as `rabbitmqctl status` reports it ("File Descriptors …
# Total: N, limit: M": the handle cache, about 97 under ulimit -n).
rabbitmq_fd_limit() {
    rmqctl 30 -q status 2>/dev/null | sed -e 's/\x1b\[[0-9;]*m//g' |
        awk '/^File Descriptors/ { fd = 1 } fd && /^Total: [0-9]+, limit: [0-9]+/ { sub(/.*limit: /, ""); print; exit }'
}

# A broker started with a small open-file limit wedges once fleet's queues fill its handle
# cache (new connections hang in the handshake): say so, with the fix. A broker that was
# already running is restarted by this script only under CI=true (see ensure_rabbitmq); for
# it ($1 = warn) this is a warning, and the status says whether the limit is too small (1).
check_rabbitmq_nofile() {
    local limit
    limit=$(rabbitmq_fd_limit)
    if [ -z "$limit" ]; then
        log "rabbitmq: could not read the file-descriptor limit from 'rabbitmqctl status'"
        return 0
    fi
    log "rabbitmq: file-descriptor limit $limit (rabbitmqctl status)"
    if [ "$limit" -lt "$((RABBITMQ_NOFILE_MIN - 100))" ]; then
        "${1:-die}" "rabbitmq: file-descriptor limit $limit is too small for fleet's queues (25 per namespace, 4 per group; see docs/scaling.md): restart it with ulimit -n $RABBITMQ_NOFILE (stop it, then run ops/services.sh again; systemd: LimitNOFILE=$RABBITMQ_NOFILE)"
        return 1
    fi
}

# ---------------------------------------------------------------------------- Python client

# The Python client's tests (clients/python, ops/python-client-test.sh): Debian's python3 with
# pika, and mypy for its type check. Debian's packages serve /usr/bin/python3 (another python3
# earlier on PATH, e.g. pyenv's, does not see them; the test script falls back to it).
ensure_python_client() {
    local py=/usr/bin/python3
    if ! { [ -x "$py" ] && "$py" -c 'import pika' >/dev/null 2>&1; }; then
        log "python3 with pika not found: installing python3 python3-pika"
        apt_install python3 python3-pika
        "$py" -c 'import pika' >/dev/null 2>&1 || die "$py still cannot import pika after installing python3-pika"
    fi
    if ! "$py" -m mypy --version >/dev/null 2>&1; then
        log "mypy not found for $py: installing python3-mypy"
        apt_install python3-mypy
        "$py" -m mypy --version >/dev/null 2>&1 || die "$py -m mypy still fails after installing python3-mypy"
    fi
    log "python client: $("$py" --version 2>&1), pika $("$py" -c 'import pika; print(pika.__version__)'), $("$py" -m mypy --version 2>&1)"
}

# ---------------------------------------------------------------------------- tools

ensure_base() {
    # curl is what the other ops scripts use to talk HTTP.
    ensure_cmd curl curl ca-certificates
}

# What the tests need beyond the services.
ensure_test_extras() {
    # libfaketime: the clock-skew test runs workers 60 s behind and ahead (tests/tests/e2e/clock_skew.rs).
    ensure_cmd faketime faketime
}

ensure_tools() {
    ensure_cmd promtool prometheus
    ensure_cmd docker-compose docker-compose
    ensure_cmd shellcheck shellcheck
    log "tools: $(promtool --version 2>&1 | head -n1)"
    log "tools: $(docker-compose version --short 2>/dev/null || docker-compose --version 2>&1 | head -n1)"
    log "tools: shellcheck $(shellcheck --version 2>/dev/null | sed -n 's/^version: //p')"
}

# The console's browser test (tests/tests/e2e/console.rs): Debian's chromium, node and npm, and
# playwright-core from tests/ui/package-lock.json (never `npx playwright install`: the
# browser is Debian's).
ensure_browser() {
    ensure_cmd chromium chromium
    ensure_cmd node nodejs
    ensure_cmd npm npm
    local ui
    ui="$(dirname "$0")/../tests/ui"
    if [ ! -d "$ui/node_modules/playwright-core" ]; then
        log "npm ci in tests/ui (playwright-core)"
        (cd "$ui" && timeout 300 npm ci --no-audit --no-fund --loglevel=error) || die "npm ci in tests/ui failed"
    fi
    log "browser: $(chromium --version 2>/dev/null | head -n1), node $(node --version)"
}

ensure_docker() {
    ensure_cmd dockerd docker.io
    ensure_cmd docker docker.io
    ensure_cmd docker-compose docker-compose
    ensure_cmd debootstrap debootstrap
    ensure_cmd objcopy binutils
    log "docker: $(docker --version 2>&1 | head -n1); $(docker-compose --version 2>&1 | head -n1)"
}

main() {
    local services=1 tools=0 browser=0 docker=0 extras=1
    while [ $# -gt 0 ]; do
        case "$1" in
        --demo) extras=0 ;;
        --tools) tools=1 ;;
        --browser) browser=1 ;;
        --tools-only)
            tools=1
            services=0
            ;;
        --docker-only)
            docker=1
            services=0
            ;;
        -h | --help)
            usage
            return 0
            ;;
        *) die "unknown argument: $1 (try --help)" ;;
        esac
        shift
    done
    ensure_base
    if [ "$tools" -eq 1 ]; then
        ensure_tools
    fi
    if [ "$browser" -eq 1 ]; then
        ensure_browser
    fi
    if [ "$docker" -eq 1 ]; then
        ensure_docker
    fi
    if [ "$services" -eq 1 ] && [ "$extras" -eq 1 ]; then
        ensure_test_extras
        ensure_python_client
    fi
    if [ "$services" -eq 1 ]; then
        ensure_redis
        ensure_rabbitmq
    fi
}

main "$@"
