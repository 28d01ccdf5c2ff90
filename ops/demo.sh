#!/usr/bin/env bash
# ops/demo.sh — run the fleet on this machine with a demo workload, without Docker.
#
# Makes sure Redis and RabbitMQ run (ops/services.sh --demo, while the binaries build: dev
# profile, the three binaries only), starts one scheduler and two workers in two label groups
# (gpu=true and gpu=false, capacity 4 each), submits a workload with fleetctl, waits until
# every task succeeded, prints what ran where, `fleetctl groups` and `fleetctl workers`, and
# stops everything with SIGTERM.
#
#   ops/demo.sh [--count N] [--namespace NS | --random-namespace] [--hold]
#
#   --count N             tasks per part of the workload (default 300; see below)
#   --namespace NS        FLEET_NAMESPACE to use. Its Redis keys are cleared and its non-empty
#                         queues purged first, so reruns start clean.
#   --random-namespace    a fresh namespace demo-<hex>, deleted again at the end (the default:
#                         the demo never touches a namespace someone else may be using)
#   --hold                keep the fleet running after the summary until Ctrl-C or SIGTERM
#
# Workload: N × sleep {"ms":20} with gpu=true, N × sleep with gpu=false, N × sleep with no
# selector (either group), 5 × fail {"times":1} (fail once, then succeed on retry) and
# 10 × echo in the critical lane.
#
# Environment: DEMO_TIMEOUT (300 s to finish the workload), READY_TIMEOUT (90 s),
# STOP_TIMEOUT (45 s), FLEET_BIN_DIR (prebuilt binaries: skip the build), FLEET_AMQP_URL /
# FLEET_REDIS_URL (local services by default).
# Process logs go to a temporary directory whose path is printed; it is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
LIB_TAG=demo
# shellcheck source=ops/lib.sh
source ops/lib.sh

COUNT=300
NS=
RANDOM_NS=1
HOLD=0
DEMO_TIMEOUT=${DEMO_TIMEOUT:-300}
READY_TIMEOUT=${READY_TIMEOUT:-90}

while [ $# -gt 0 ]; do
    case "$1" in
    --count)
        COUNT=${2:?--count needs a number}
        shift
        ;;
    --namespace)
        NS=${2:?--namespace needs a name}
        RANDOM_NS=0
        shift
        ;;
    --random-namespace) RANDOM_NS=1 ;;
    --hold) HOLD=1 ;;
    -h | --help)
        script_help
        exit 0
        ;;
    *) die "unknown argument: $1 (try --help)" ;;
    esac
    shift
done
case "$COUNT" in '' | *[!0-9]*) die "--count must be a number, got '$COUNT'" ;; esac
if [ "$RANDOM_NS" -eq 1 ]; then
    NS=$(random_namespace demo)
    log "using a fresh namespace $NS (deleted at the end; --namespace NS picks one)"
fi

# The services and the build at once: on a fresh machine apt and a RabbitMQ boot take tens of
# seconds the compiler need not wait for (issue 29: the first task within 3 minutes).
bash ops/services.sh --demo &
services_pid=$!
locate_binaries   # sets BIN (FLEET_BIN_DIR, or the dev-profile build)
wait "$services_pid" || die "ops/services.sh --demo failed (its messages above say why)"

LOGS=$(mktemp -d "${TMPDIR:-/tmp}/fleet-demo.XXXXXX")
export FLEET_NAMESPACE=$NS
export FLEET_LOG_FORMAT=${FLEET_LOG_FORMAT:-text}

# Start from a clean namespace: stale registrations from an earlier run would be counted as
# capacity, and leftover tasks would be run again.
if [ "$RANDOM_NS" -eq 0 ]; then
    stale=$(timeout 30 redis-cli -u "${FLEET_REDIS_URL:-redis://127.0.0.1:6379}" --scan --pattern "{$NS}:*" 2>/dev/null | wc -l || true)
    if [ "${stale:-0}" -gt 0 ]; then
        log "namespace $NS: clearing $stale Redis keys of an earlier run"
        timeout 30 redis-cli -u "${FLEET_REDIS_URL:-redis://127.0.0.1:6379}" --scan --pattern "{$NS}:*" 2>/dev/null |
            xargs -r -d '\n' -n 200 timeout 30 redis-cli -u "${FLEET_REDIS_URL:-redis://127.0.0.1:6379}" del >/dev/null 2>&1 || true
    fi
    if _local_broker_ok; then
        while read -r q msgs; do
            case "$q" in "$NS".*) ;; *) continue ;; esac
            if [ "${msgs:-0}" != 0 ]; then
                log "namespace $NS: purging $msgs leftover messages from $q"
                timeout 30 rabbitmqctl -q purge_queue "$q" </dev/null >/dev/null 2>&1 || warn "could not purge $q"
            fi
        done < <(timeout 30 rabbitmqctl -q list_queues --no-table-headers name messages 2>/dev/null || true)
    fi
else
    CLEANUP_HOOKS+=(demo_delete_namespace)
fi
demo_delete_namespace() { delete_namespace "$NS"; }
demo_print_logs() { log "process logs: $LOGS"; }
CLEANUP_HOOKS+=(demo_print_logs)
install_cleanup_trap

SCHED_PORT=$(free_port)
declare -A PORT=()
used=" $SCHED_PORT "
for w in gpu cpu; do
    p=$(free_port)
    while [[ "$used" == *" $p "* ]]; do p=$(free_port); done
    PORT[$w]=$p
    used+="$p "
done
SCHED=http://127.0.0.1:$SCHED_PORT
export FLEET_API_URL=$SCHED
log "namespace $NS; scheduler $SCHED; logs in $LOGS"

start_proc scheduler "$LOGS/scheduler.log" env FLEET_HTTP_ADDR="127.0.0.1:$SCHED_PORT" "$BIN/fleet-scheduler"
declare -A LABELS=([gpu]=gpu=true [cpu]=gpu=false)
for w in gpu cpu; do
    start_proc "worker-$w" "$LOGS/worker-$w.log" \
        env FLEET_HTTP_ADDR="127.0.0.1:${PORT[$w]}" FLEET_WORKER_ID="$NS-$w-1" \
        FLEET_LABELS="${LABELS[$w]}" FLEET_CAPACITY=4 FLEET_CRITICAL_CAPACITY=1 FLEET_EXECUTOR=builtin \
        "$BIN/fleet-worker"
done
wait_ready scheduler "$SCHED/readyz" "$READY_TIMEOUT"
for w in gpu cpu; do
    wait_ready "worker-$w" "http://127.0.0.1:${PORT[$w]}/readyz" "$READY_TIMEOUT"
done

# ------------------------------------------------------------------------------ workload

TOTAL=0
REFUSED=0
# submit DESCRIPTION ARGS...: one fleetctl submit; refusals are reported, not fatal.
submit() {
    local what=$1 out rc=0 acc ref
    shift
    out=$("$BIN/fleetctl" submit "$@" 2>&1) || rc=$?
    acc=$(sed -n 's/.*accepted=\([0-9][0-9]*\).*/\1/p' <<<"$out" | tail -n1)
    ref=$(sed -n 's/.*refused=\([0-9][0-9]*\).*/\1/p' <<<"$out" | tail -n1)
    if [ -z "$acc" ]; then
        printf '%s\n' "$out" >&2
        die "fleetctl submit ($what) failed (exit $rc)"
    fi
    TOTAL=$((TOTAL + acc))
    REFUSED=$((REFUSED + ${ref:-0}))
    printf '  %-42s accepted=%-5s refused=%s\n' "$what" "$acc" "${ref:-0}"
}
echo
echo "Submitting the workload:"
T0=$SECONDS
submit "$COUNT × sleep 20ms, gpu=true" --kind sleep --payload '{"ms":20}' --labels gpu=true --count "$COUNT"
submit "$COUNT × sleep 20ms, gpu=false" --kind sleep --payload '{"ms":20}' --labels gpu=false --count "$COUNT"
submit "$COUNT × sleep 20ms, any worker" --kind sleep --payload '{"ms":20}' --count "$COUNT"
submit "5 × fail once, then succeed" --kind fail --payload '{"times":1}' --count 5
submit "10 × echo, critical lane" --kind echo --payload '{"demo":true}' --lane critical --count 10
[ "$REFUSED" -eq 0 ] || warn "$REFUSED tasks were refused by the fleet (backpressure); waiting for the $TOTAL accepted"
echo

# ---------------------------------------------------------------------------------- wait

scrape_workers() {
    local w
    for w in gpu cpu; do
        curl -fsS --max-time 5 "http://127.0.0.1:${PORT[$w]}/metrics" >"$LOGS/worker-$w.metrics" 2>/dev/null ||
            : >"$LOGS/worker-$w.metrics"
    done
}
succeeded() {
    local w sum=0
    for w in gpu cpu; do
        sum=$((sum + $(metric_sum "$LOGS/worker-$w.metrics" fleet_tasks_completed_total outcome=succeeded)))
    done
    echo "$sum"
}

log "waiting for $TOTAL tasks to succeed (at most ${DEMO_TIMEOUT}s)"
deadline=$((SECONDS + DEMO_TIMEOUT))
last_report=0
finished=0
while :; do
    scrape_workers
    ok=$(succeeded)
    if [ "$ok" -ge "$TOTAL" ]; then
        finished=1
        break
    fi
    if [ $((SECONDS - last_report)) -ge 3 ]; then
        log "succeeded $ok / $TOTAL"
        last_report=$SECONDS
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        warn "only $ok of $TOTAL tasks succeeded within ${DEMO_TIMEOUT}s"
        break
    fi
    # A worker that died will never finish the workload.
    for name in scheduler worker-gpu worker-cpu; do
        i=$(proc_index "$name")
        if ! proc_alive "${PROC_PIDS[$i]}"; then
            show_log_tail "${PROC_LOGS[$i]}"
            die "$name exited during the demo"
        fi
    done
    sleep 0.5
done
ELAPSED=$((SECONDS - T0))
scrape_workers
curl -fsS --max-time 5 "$SCHED/metrics" >"$LOGS/scheduler.metrics" 2>/dev/null || : >"$LOGS/scheduler.metrics"

# ------------------------------------------------------------------------------- summary

echo
echo "What ran where ($TOTAL tasks in ${ELAPSED}s): user task attempts by outcome, per worker"
echo "(the outcomes of fleet_tasks_completed_total; health probes are counted apart, in"
echo "fleet_probes_completed_total)"
echo
echo "\$ fleetctl workers"
"$BIN/fleetctl" workers || warn "fleetctl workers failed"
echo

# By lane, and what the scheduler dispatched to each group.
for w in gpu cpu; do
    f="$LOGS/worker-$w.metrics"
    printf '  %-10s succeeded by lane: normal=%s critical=%s\n' "worker-$w" \
        "$(metric_sum "$f" fleet_tasks_completed_total outcome=succeeded lane=normal)" \
        "$(metric_sum "$f" fleet_tasks_completed_total outcome=succeeded lane=critical)"
done
while IFS= read -r g; do
    [ -n "$g" ] || continue
    printf '  scheduler dispatched to group %-20s %s\n' "$g" \
        "$(metric_sum "$LOGS/scheduler.metrics" fleet_tasks_dispatched_total "group=$g")"
done < <(label_values "$LOGS/scheduler.metrics" fleet_tasks_dispatched_total group)
echo "  expected: the gpu=true tasks all on worker-gpu, the gpu=false ones on worker-cpu, the"
echo "  others ($COUNT sleep + 5 fail + 10 echo) spread over both by load."
gpu_ok=$(metric_sum "$LOGS/worker-gpu.metrics" fleet_tasks_completed_total outcome=succeeded lane=normal)
cpu_ok=$(metric_sum "$LOGS/worker-cpu.metrics" fleet_tasks_completed_total outcome=succeeded lane=normal)
[ "$gpu_ok" -ge "$COUNT" ] || warn "worker-gpu ran $gpu_ok normal-lane tasks, fewer than the $COUNT gpu=true ones"
[ "$cpu_ok" -ge "$COUNT" ] || warn "worker-cpu ran $cpu_ok normal-lane tasks, fewer than the $COUNT gpu=false ones"
echo

echo "\$ fleetctl groups"
"$BIN/fleetctl" groups || warn "fleetctl groups failed"
echo

if [ "$HOLD" -eq 1 ]; then
    log "the fleet keeps running; in another shell: export FLEET_API_URL=$SCHED FLEET_NAMESPACE=$NS; then use $BIN/fleetctl. Ctrl-C here stops it"
    # `wait` returns on a signal (a foreground `sleep` would hold the TERM trap until it ends).
    while :; do
        sleep 3600 &
        wait $! || true
    done
fi

stop_procs || warn "a process had to be killed after SIGTERM"
if [ "$finished" -ne 1 ]; then
    die "the workload did not finish; logs in $LOGS"
fi
log "demo finished: $TOTAL tasks in ${ELAPSED}s"
