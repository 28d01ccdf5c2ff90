#!/usr/bin/env bash
# ops/check-metrics.sh — live check of what the binaries expose on /metrics.
#
# Builds the binaries (dev profile), starts one scheduler and one worker on free ports under a
# random namespace (against the local RabbitMQ and Redis, or FLEET_AMQP_URL / FLEET_REDIS_URL),
# waits for /readyz on both, runs a few tasks through them with fleetctl, then scrapes both
# /metrics endpoints and:
#   - pipes each into `promtool check metrics`: a parse error fails; lint findings are printed
#     as warnings (they fail too with CHECK_METRICS_STRICT=1);
#   - checks that the metric names the dashboard and the alerts rely on are there.
# Finally stops both processes with SIGTERM (SIGKILL after STOP_TIMEOUT seconds) and deletes
# the namespace's Redis keys, queues and exchanges. A trap stops the processes on every exit path.
#
# Environment: READY_TIMEOUT (90 s), DONE_TIMEOUT (120 s), STOP_TIMEOUT (45 s), FLEET_BIN_DIR
# (prebuilt binaries: skip the build),
# CHECK_METRICS_STRICT (0), KEEP_LOGS (0: the log directory is removed when all passed),
# FLEET_QUEUE_TYPE (classic here: cheap to create and delete; set quorum to check that too).
set -euo pipefail
cd "$(dirname "$0")/.."
LIB_TAG=check-metrics
# shellcheck source=ops/lib.sh
source ops/lib.sh

READY_TIMEOUT=${READY_TIMEOUT:-90}
DONE_TIMEOUT=${DONE_TIMEOUT:-120}
STRICT=${CHECK_METRICS_STRICT:-0}
KEEP_LOGS=${KEEP_LOGS:-0}

# Metric names that must be present after a few tasks ran (on the scheduler or the worker),
# and names that only appear after some event (a rejection, an eviction, a probe...).
REQUIRED_METRICS=(
    fleet_tasks_submitted_total
    fleet_tasks_dispatched_total
    fleet_tasks_completed_total
    fleet_task_wait_seconds_bucket
    fleet_task_run_seconds_bucket
    fleet_queue_depth
    fleet_pressure_state
    fleet_group_capacity
    fleet_group_load
    fleet_group_reserved
    fleet_workers
    fleet_groups
    fleet_worker_info
    fleet_scaling_ready
    fleet_scaling_blocked
    fleet_scaling_oldest_ready_age_seconds
)
OPTIONAL_METRICS=(
    fleet_groups_reclaimed_total
    fleet_queue_bound
    fleet_group_backlog
    fleet_group_oldest_task_age_seconds
    fleet_tasks_rejected_total
    fleet_worker_evictions_total
    fleet_dispatch_throttled_total
    fleet_probe_seconds_bucket
    fleet_probe_failures_total
    fleet_probes_completed_total
    fleet_key_running
    fleet_key_waiting
    fleet_key_max_running
)

bash ops/services.sh --tools

locate_binaries   # sets BIN (FLEET_BIN_DIR, or the dev-profile build)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/fleet-check-metrics.XXXXXX")
NS=$(random_namespace fleetcheck)
export FLEET_NAMESPACE=$NS
export FLEET_QUEUE_TYPE=${FLEET_QUEUE_TYPE:-classic}
export FLEET_LOG_FORMAT=${FLEET_LOG_FORMAT:-text}
SCHED_PORT=$(free_port)
WORKER_PORT=$(free_port)
while [ "$WORKER_PORT" = "$SCHED_PORT" ]; do WORKER_PORT=$(free_port); done
SCHED=http://127.0.0.1:$SCHED_PORT
WORKER=http://127.0.0.1:$WORKER_PORT
export FLEET_API_URL=$SCHED
log "namespace $NS, scheduler $SCHED, worker $WORKER, logs in $WORK"

PASSED=0
finish() {
    delete_namespace "$NS" || true
    if [ "$PASSED" -eq 1 ] && [ "$KEEP_LOGS" != 1 ]; then
        rm -rf "$WORK"
    else
        log "logs and scrapes kept in $WORK"
    fi
}
CLEANUP_HOOKS+=(finish)
install_cleanup_trap

start_proc scheduler "$WORK/scheduler.log" \
    env FLEET_HTTP_ADDR="127.0.0.1:$SCHED_PORT" "$BIN/fleet-scheduler"
start_proc worker "$WORK/worker.log" \
    env FLEET_HTTP_ADDR="127.0.0.1:$WORKER_PORT" FLEET_WORKER_ID="$NS-w1" \
    FLEET_LABELS=check=metrics FLEET_CAPACITY=4 FLEET_CRITICAL_CAPACITY=1 FLEET_EXECUTOR=builtin \
    "$BIN/fleet-worker"
wait_ready scheduler "$SCHED/readyz" "$READY_TIMEOUT"
wait_ready worker "$WORKER/readyz" "$READY_TIMEOUT"
for url in "$SCHED/healthz" "$WORKER/healthz"; do
    [ "$(http_code "$url")" = 200 ] || die "$url does not answer 200"
done

# submit ARGS...: fleetctl submit; adds the number of accepted tasks to $total.
total=0
submit() {
    local out rc=0 n
    out=$("$BIN/fleetctl" submit "$@" 2>&1) || rc=$?
    printf '%s\n' "$out" | sed 's/^/  fleetctl: /' >&2
    [ "$rc" -eq 0 ] || die "fleetctl submit $* failed (exit $rc)"
    n=$(sed -n 's/.*accepted=\([0-9][0-9]*\).*/\1/p' <<<"$out" | tail -n1)
    [ -n "$n" ] || die "fleetctl submit printed no accepted=N line"
    total=$((total + n))
}
submit --kind noop --count 5
submit --kind sleep --payload '{"ms":10}' --labels check=metrics --count 5
submit --kind echo --payload '{"hello":"metrics"}' --lane critical --count 2
# One failure then a success: exercises the retried outcome and the retry path.
submit --kind fail --payload '{"times":1}' --count 1
[ "$total" -gt 0 ] || die "fleetctl accepted no task"
log "$total tasks accepted; waiting for them to succeed (at most ${DONE_TIMEOUT}s)"

deadline=$((SECONDS + DONE_TIMEOUT))
while :; do
    curl -fsS --max-time 5 "$WORKER/metrics" >"$WORK/worker.metrics" 2>/dev/null || : >"$WORK/worker.metrics"
    done_ok=$(metric_sum "$WORK/worker.metrics" fleet_tasks_completed_total outcome=succeeded)
    [ "$done_ok" -ge "$total" ] && break
    if [ "$SECONDS" -ge "$deadline" ]; then
        grep '^fleet_tasks_completed_total' "$WORK/worker.metrics" >&2 || true
        show_log_tail "$WORK/worker.log"
        show_log_tail "$WORK/scheduler.log"
        die "only $done_ok of $total tasks succeeded within ${DONE_TIMEOUT}s"
    fi
    sleep 0.5
done
log "$done_ok tasks succeeded"
# Let the scheduler's periodic gauges (queue depth, group load) catch up once.
sleep "${SETTLE_SECONDS:-3}"

failures=0
fail() {
    printf '[check-metrics] FAIL: %s\n' "$*" >&2
    failures=$((failures + 1))
}

for who in scheduler worker; do
    url=$SCHED
    [ "$who" = worker ] && url=$WORKER
    file="$WORK/$who.metrics"
    if ! curl -fsS --max-time 10 "$url/metrics" >"$file"; then
        fail "$who: GET $url/metrics failed"
        continue
    fi
    ctype=$(curl -sS --max-time 10 -o /dev/null -w '%{content_type}' "$url/metrics" || true)
    case "$ctype" in
    text/plain*) ;;
    *) warn "$who: /metrics Content-Type is '$ctype' (Prometheus expects text/plain; version=0.0.4)" ;;
    esac
    log "$who: $(grep -c -v '^#' "$file" || true) samples, $(metric_names "$file" | wc -l) metrics"
    rc=0
    out=$(promtool check metrics <"$file" 2>&1) || rc=$?
    case "$rc" in
    0) log "$who: promtool check metrics: ok" ;;
    3)
        printf '%s\n' "$out" | sed "s/^/[check-metrics] WARNING: $who: /" >&2
        if [ "$STRICT" = 1 ]; then fail "$who: promtool lint findings (CHECK_METRICS_STRICT=1)"; fi
        ;;
    *)
        printf '%s\n' "$out" >&2
        fail "$who: promtool check metrics failed (exit $rc)"
        ;;
    esac
done

cat "$WORK/scheduler.metrics" "$WORK/worker.metrics" >"$WORK/all.metrics" 2>/dev/null || true
metric_names "$WORK/all.metrics" | sort -u >"$WORK/names.txt"
for m in "${REQUIRED_METRICS[@]}"; do
    grep -qxF "$m" "$WORK/names.txt" || fail "metric $m is missing from both /metrics"
done
for m in "${OPTIONAL_METRICS[@]}"; do
    grep -qxF "$m" "$WORK/names.txt" || log "note: optional metric $m not exposed (some appear only after the event they count)"
done
# Labels the dashboard, the alerts and demo.sh read.
[ -n "$(label_values "$WORK/worker.metrics" fleet_worker_info group)" ] ||
    fail "fleet_worker_info has no group label"
[ -n "$(label_values "$WORK/worker.metrics" fleet_worker_info worker)" ] ||
    fail "fleet_worker_info has no worker label"
for l in group lane outcome; do
    [ -n "$(label_values "$WORK/worker.metrics" fleet_tasks_completed_total "$l")" ] ||
        fail "fleet_tasks_completed_total has no $l label"
done
[ -n "$(label_values "$WORK/all.metrics" fleet_queue_depth queue)" ] ||
    fail "fleet_queue_depth has no queue label"
# No unbounded label values: task ids must never be labels.
if grep -Eq '^fleet_[a-z_]+\{[^}]*(task_id|[{,]id)="' "$WORK/all.metrics"; then
    fail "a fleet_ metric carries a task id label"
fi

if stop_procs; then :; else fail "a process had to be killed after SIGTERM"; fi
for f in "$WORK/scheduler.log" "$WORK/worker.log"; do
    if grep -Eq 'panicked at|RUST_BACKTRACE' "$f"; then
        show_log_tail "$f" 40
        fail "$(basename "$f" .log) panicked"
    fi
done

if [ "$failures" -gt 0 ]; then
    die "$failures check(s) failed"
fi
PASSED=1
log "all metrics checks passed"
