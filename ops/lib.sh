# shellcheck shell=bash
# ops/lib.sh — helpers shared by ops/check-metrics.sh, ops/demo.sh and ops/compose-test.sh.
# Source it; it does nothing by itself. Processes started with start_proc are tracked and
# stopped by stop_procs, which the EXIT trap installed by install_cleanup_trap also calls, so
# none outlives the script.

LIB_TAG=${LIB_TAG:-ops}

log() { printf '[%s] %s\n' "$LIB_TAG" "$*" >&2; }
warn() { printf '[%s] WARNING: %s\n' "$LIB_TAG" "$*" >&2; }
die() {
    printf '[%s] ERROR: %s\n' "$LIB_TAG" "$*" >&2
    exit 1
}

# script_help: prints the calling script's header comment (line 2 up to `set -euo`) as its --help.
script_help() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

# ------------------------------------------------------------------------- build artefacts

# The directory cargo builds into (honours CARGO_TARGET_DIR and .cargo/config).
cargo_target_dir() {
    local dir
    dir=$(cargo metadata --no-deps --format-version 1 2>/dev/null |
        sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
    printf '%s\n' "${dir:-${CARGO_TARGET_DIR:-target}}"
}

# ----------------------------------------------------------------------------- network

# A TCP port on 127.0.0.1 that nothing listens on right now.
free_port() {
    local port i
    if command -v python3 >/dev/null 2>&1; then
        port=$(python3 -c 'import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])' 2>/dev/null) && [ -n "$port" ] && {
            echo "$port"
            return 0
        }
    fi
    for i in $(seq 1 200); do
        port=$((20000 + (RANDOM % 30000)))
        # shellcheck disable=SC2016 # expanded by the inner bash
        if ! timeout 1 bash -c 'exec 3<>"/dev/tcp/127.0.0.1/$1"' _ "$port" 2>/dev/null; then
            echo "$port"
            return 0
        fi
        : "$i"
    done
    die "no free TCP port found"
}

# A namespace nobody else uses: PREFIX-<8 hex digits>.
random_namespace() {
    printf '%s-%s\n' "$1" "$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')"
}

# http_code URL: the HTTP status of a GET (000 when nothing answers).
http_code() {
    curl -s -o /dev/null -w '%{http_code}' --max-time 3 "$1" 2>/dev/null || true
}

# ---------------------------------------------------------------------------- processes

PROC_PIDS=()
PROC_NAMES=()
PROC_LOGS=()
STOP_TIMEOUT=${STOP_TIMEOUT:-45}

# start_proc NAME LOGFILE COMMAND...: run COMMAND in the background, output to LOGFILE.
# Set variables for it with `env VAR=value ... command`.
start_proc() {
    local name=$1 logfile=$2
    shift 2
    "$@" >"$logfile" 2>&1 </dev/null &
    PROC_PIDS+=("$!")
    PROC_NAMES+=("$name")
    PROC_LOGS+=("$logfile")
    log "started $name (pid $!, log $logfile)"
}

proc_index() {
    local i
    for i in "${!PROC_NAMES[@]}"; do
        if [ "${PROC_NAMES[$i]}" = "$1" ]; then
            echo "$i"
            return 0
        fi
    done
    return 1
}

proc_alive() { kill -0 "$1" 2>/dev/null; }

show_log_tail() {
    local logfile=$1
    if [ -s "$logfile" ]; then
        echo "----- last lines of $logfile -----" >&2
        tail -n "${2:-30}" "$logfile" >&2
        echo "-----" >&2
    fi
}

# wait_ready NAME URL TIMEOUT: wait until URL answers 200; fail early if NAME exits.
wait_ready() {
    local name=$1 url=$2 timeout=$3 i pid logfile code=000
    i=$(proc_index "$name") || die "unknown process $name"
    pid=${PROC_PIDS[$i]}
    logfile=${PROC_LOGS[$i]}
    local deadline=$((SECONDS + timeout))
    while :; do
        code=$(http_code "$url")
        if [ "$code" = 200 ]; then
            log "$name ready ($url)"
            return 0
        fi
        if ! proc_alive "$pid"; then
            show_log_tail "$logfile"
            die "$name (pid $pid) exited before it was ready"
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            show_log_tail "$logfile"
            die "$name not ready within ${timeout}s ($url answered $code)"
        fi
        sleep 0.5
    done
}

# stop_procs: SIGTERM every tracked process still running, wait up to STOP_TIMEOUT seconds
# for all of them, then SIGKILL what is left. Returns 1 if any had to be killed.
stop_procs() {
    local i pid alive deadline killed=0
    [ "${#PROC_PIDS[@]}" -gt 0 ] || return 0
    for i in "${!PROC_PIDS[@]}"; do
        pid=${PROC_PIDS[$i]}
        if proc_alive "$pid"; then
            log "stopping ${PROC_NAMES[$i]} (SIGTERM to pid $pid)"
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    deadline=$((SECONDS + STOP_TIMEOUT))
    while :; do
        alive=0
        for pid in "${PROC_PIDS[@]}"; do
            if proc_alive "$pid"; then alive=1; fi
        done
        [ "$alive" -eq 0 ] && break
        if [ "$SECONDS" -ge "$deadline" ]; then
            for i in "${!PROC_PIDS[@]}"; do
                pid=${PROC_PIDS[$i]}
                if proc_alive "$pid"; then
                    warn "${PROC_NAMES[$i]} (pid $pid) still running ${STOP_TIMEOUT}s after SIGTERM: SIGKILL"
                    kill -KILL "$pid" 2>/dev/null || true
                    killed=1
                fi
            done
            break
        fi
        sleep 0.5
    done
    # Reap them and report how each one ended.
    for i in "${!PROC_PIDS[@]}"; do
        local rc=0
        wait "${PROC_PIDS[$i]}" 2>/dev/null || rc=$?
        log "${PROC_NAMES[$i]} exited with status $rc"
    done
    PROC_PIDS=()
    PROC_NAMES=()
    PROC_LOGS=()
    return "$killed"
}

# The EXIT trap runs CLEANUP_HOOKS (function names, in order) after stopping the processes.
CLEANUP_HOOKS=()
_cleanup_on_exit() {
    local rc=$?
    trap - EXIT INT TERM
    stop_procs || true
    local hook
    for hook in "${CLEANUP_HOOKS[@]}"; do
        "$hook" || true
    done
    exit "$rc"
}
install_cleanup_trap() {
    trap _cleanup_on_exit EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
}

# -------------------------------------------------------------------------------- metrics

# The awk helpers below read Prometheus text format: `name{k="v",...} value [timestamp]`.
# label(labels, key) returns the value of key in a `k="v",k2="v2"` string ("" if absent).
_PROM_AWK_LIB='
function label(labels, key,    s, p, v) {
    s = "," labels
    p = index(s, "," key "=\"")
    if (p == 0) return ""
    s = substr(s, p + length(key) + 3)
    v = ""
    while (length(s) > 0) {
        c = substr(s, 1, 1)
        if (c == "\\") { v = v substr(s, 2, 1); s = substr(s, 3); continue }
        if (c == "\"") break
        v = v c; s = substr(s, 2)
    }
    return v
}
# split_sample(line): sets NAME, LABELS, VALUE; returns 0 for comments and blank lines.
function split_sample(line,    b, e, rest, parts) {
    if (line ~ /^[ \t]*(#|$)/) return 0
    b = index(line, "{")
    sp = index(line, " ")
    if (b > 0 && (sp == 0 || b < sp)) {
        NAME = substr(line, 1, b - 1)
        e = index(line, "} ")
        if (e == 0) e = length(line)
        LABELS = substr(line, b + 1, e - b - 1)
        rest = substr(line, e + 1)
    } else {
        NAME = substr(line, 1, sp - 1)
        LABELS = ""
        rest = substr(line, sp + 1)
    }
    split(rest, parts, " ")
    VALUE = parts[1]
    return 1
}
'

# metric_sum FILE NAME [LABEL=VALUE...]: sum of the samples of metric NAME (exact name) in
# the Prometheus text in FILE whose labels have every LABEL=VALUE given. Prints an integer.
metric_sum() {
    local file=$1 name=$2
    shift 2
    awk -v name="$name" -v filters="$*" "$_PROM_AWK_LIB"'
        BEGIN { nf = split(filters, f, " ") }
        {
            if (!split_sample($0)) next
            if (NAME != name) next
            for (i = 1; i <= nf; i++) {
                eq = index(f[i], "=")
                if (label(LABELS, substr(f[i], 1, eq - 1)) != substr(f[i], eq + 1)) next
            }
            sum += VALUE
        }
        END { printf "%.0f\n", sum + 0 }
    ' "$file"
}

# label_values FILE NAME LABEL: the distinct values of LABEL on the samples of NAME.
label_values() {
    awk -v name="$2" -v key="$3" "$_PROM_AWK_LIB"'
        {
            if (!split_sample($0) || NAME != name) next
            v = label(LABELS, key)
            if (v != "" && !(v in seen)) { seen[v] = 1; print v }
        }
    ' "$1"
}

# metric_names FILE: the distinct metric names with samples in FILE.
metric_names() {
    awk "$_PROM_AWK_LIB"'{ if (split_sample($0) && !(NAME in seen)) { seen[NAME] = 1; print NAME } }' "$1"
}

# ------------------------------------------------------------------------------ clean-up

_local_broker_ok() {
    # Only a broker on this machine, in the default vhost, reached through rabbitmqctl.
    local url=${FLEET_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f} rest host vhost
    rest=${url#*://}
    rest=${rest#*@}
    host=${rest%%[:/]*}
    vhost=${rest#*/}
    [ "$vhost" = "$rest" ] && vhost=""
    case "$host" in 127.0.0.1 | localhost | "[::1]") ;; *) return 1 ;; esac
    case "$vhost" in "" | %2f | %2F) ;; *) return 1 ;; esac
    command -v rabbitmqctl >/dev/null 2>&1 || return 1
    [ "$(id -u)" -eq 0 ] || [ "$(id -un)" = rabbitmq ]
}

# delete_namespace NS: best effort, bounded: drop the Redis keys `{NS}:*`, the AMQP queues
# `NS.*` and the exchanges of a namespace this script made up. Queues are deleted one at a
# time: deleting many quorum queues at once has upset RabbitMQ 3.10. The exchanges (which
# rabbitmqctl cannot delete) go with `fleetctl delete-namespace`.
delete_namespace() {
    local ns=$1 budget=${2:-90} redis_url=${FLEET_REDIS_URL:-redis://127.0.0.1:6379} keys=0 q n=0
    if command -v redis-cli >/dev/null 2>&1; then
        local keyfile
        keyfile=$(mktemp)
        timeout 30 redis-cli -u "$redis_url" --scan --pattern "{$ns}:*" >"$keyfile" 2>/dev/null || true
        keys=$(wc -l <"$keyfile")
        xargs -r -d '\n' -n 200 timeout 30 redis-cli -u "$redis_url" del <"$keyfile" >/dev/null 2>&1 || true
        rm -f "$keyfile"
    fi
    if ! _local_broker_ok; then
        log "namespace $ns: deleted $keys Redis keys; AMQP queues left (broker not local or no rabbitmqctl)"
        return 0
    fi
    # fleetctl first: it finds every queue of the namespace (the broker's queue catalog and the
    # name rules) and deletes them over a few channels in one process; rabbitmqctl (a VM start
    # per call, ~0.7 s) then only for what it left.
    if [ -n "${BIN:-}" ] && [ -x "$BIN/fleetctl" ]; then
        local before
        before=$(timeout 30 rabbitmqctl -q list_queues --no-table-headers name 2>/dev/null | grep -c "^$ns\." || true)
        if timeout 60 "$BIN/fleetctl" --namespace "$ns" --redis-url "$redis_url" delete-namespace --yes >/dev/null 2>&1; then
            n=${before:-0}
        else
            warn "namespace $ns: fleetctl delete-namespace failed; deleting its queues one by one"
        fi
    fi
    local deadline=$((SECONDS + budget)) left=0
    while IFS= read -r q; do
        case "$q" in "$ns".*) ;; *) continue ;; esac
        if [ "$SECONDS" -ge "$deadline" ]; then
            warn "namespace $ns: queue clean-up stopped after ${budget}s; delete the rest of $ns.* by hand"
            break
        fi
        if timeout 30 rabbitmqctl -q delete_queue "$q" </dev/null >/dev/null 2>&1; then left=$((left + 1)); fi
    done < <(timeout 30 rabbitmqctl -q list_queues --no-table-headers name 2>/dev/null || true)
    # Queues fleetctl left are among those counted before it ran; without fleetctl, count these.
    [ "$n" -gt 0 ] || n=$left
    log "namespace $ns: deleted $keys Redis keys, $n queues and its exchanges"
}

# The three binaries the demo and the compose images run. Their dev-profile build is the start
# of the one `cargo test` (ops/test.sh) makes: every dependency resolves with the same features
# in both (shared/Cargo.toml; ops/check-config.sh checks it), so the test build reuses all of it
# and compiles only the test crates on top — a new user compiles each crate once, and the
# first task does not wait for the test crates (issue 29 item 9).
FLEET_BUILD_PACKAGES=(-p fleet-scheduler -p fleet-worker -p fleetctl)

# locate_binaries: sets BIN to the folder holding fleet-scheduler, fleet-worker and fleetctl.
# FLEET_BIN_DIR names binaries built elsewhere (no cargo build); otherwise the dev-profile
# build of FLEET_BUILD_PACKAGES.
locate_binaries() {
    if [ -n "${FLEET_BIN_DIR:-}" ]; then
        BIN=$FLEET_BIN_DIR
        log "using the binaries in $BIN (FLEET_BIN_DIR)"
    else
        log "building the binaries (dev profile, shared with ops/test.sh; the first build takes a few minutes, later ones seconds)"
        cargo build "${FLEET_BUILD_PACKAGES[@]}" --bins
        BIN="$(cargo_target_dir)/debug"
    fi
    local b
    for b in fleet-scheduler fleet-worker fleetctl; do
        [ -x "$BIN/$b" ] || die "$BIN/$b not found"
    done
}
