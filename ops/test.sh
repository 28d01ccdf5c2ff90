#!/usr/bin/env bash
# ops/test.sh — run every test: the one command for CI (.ci/run) and for developers.
#
#   1. ops/services.sh        Redis and RabbitMQ installed and running; chromium, node and
#                             playwright-core for the console's browser test (--browser)
#   2. ops/check-config.sh    Prometheus config, alert rules (+ their unit tests), compose
#                             file, Grafana dashboard, Dockerfile members, shellcheck
#      habits                 cargo fmt --check, clippy -D warnings, rustdoc -D warnings
#   3. cargo test --workspace --no-fail-fast [EXTRA ARGS...]   unit, end-to-end and fault
#      tests, three at a time (RUST_TEST_THREADS), every test binary run even when one fails (debug build:
#      it compiles several times faster than release on a 2-core machine; speed is measured by
#      the benchmarks, not by tests). The end-to-end and fault tests are one binary,
#      `e2e` (tests/tests/e2e/, a module per story): one story is
#      `cargo test -p fleet-tests --test e2e -- smoke::`. tests/tests/e2e/cluster.rs starts its own private three-node
#      RabbitMQ cluster and Redis master + replica + Sentinels with ops/cluster.sh (1-4 min on a
#      loaded 2-core machine), kills a node and the Redis master, and stops them all
#   4. ops/python-client-test.sh   the Python client (clients/python): mypy --strict and its
#                             tests against scheduler and worker processes of the debug build
#      ops/check-metrics.sh   live /metrics of a scheduler and a worker through promtool
#   5. ops/compose-test.sh    the compose deployment: images built without a registry (the
#                             fleet image from the debug binaries of step 3), started, scaled,
#                             checked end to end, removed
#   6. ops/fuzz.sh N          every fuzz target (envelope, selector, config, submit_body) for
#                             N = FLEET_FUZZ_SECONDS s (default 20; 0 skips the step); fails on
#                             any crash. Installs cargo-fuzz when missing; builds in fuzz/target
#                             (an unoptimised instrumented build of the fleet lib and its
#                             dependencies, not rebuilt when warm). Runs alone, after the rest:
#                             the suite is CPU-bound
#
#   ops/test.sh [ARGS...]     ARGS go to cargo test, e.g. `ops/test.sh -- --nocapture`
#                             (every binary gets them, the e2e one too)
#
# Stops at once only when the services or the build fail (nothing after them can run).
# Otherwise every step runs — one failing test binary (a frozen shared broker) must not hide
# the others' results — and the end lists every failed step and failed test, then exits
# non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."

step() {
    printf '\n==== %s (at %ss)\n' "$*" "$((SECONDS - start))"
}

start=$SECONDS
cat <<'EOF_NOTE'
ops/test.sh may install Debian packages with apt (root or sudo), once, when they are missing:
  redis-server, rabbitmq-server   the tests run against real servers on 127.0.0.1 (some start
                                  private nodes of their own on free ports)
  faketime                        libfaketime: the clock-skew test runs workers 60 s off
  python3-pika, python3-mypy      the Python client's tests and type check (clients/python)
  prometheus (promtool), docker-compose, shellcheck
                                  the configuration checks (alert rules and their unit tests,
                                  the compose file, the shell scripts)
  docker.io, debootstrap, binutils
                                  the compose deployment (ops/compose-test.sh starts its own
                                  dockerd when none runs, and stops it)
Already-installed packages and running services are left alone, but for a RabbitMQ whose
open-file limit is too small for the suite: it is stopped and started again with the limit.
EOF_NOTE
step "services"
# The suite needs a broker with more than the usual 1,024 open files (it ran out mid-suite,
# Mnesia died with emfile and every later test failed): one left with fewer is restarted.
RABBITMQ_RESTART=1 bash ops/services.sh --browser
failed_steps=()
# Runs a step that may fail without stopping the others.
checked() {
    local name=$1
    shift
    step "$name"
    if ! "$@"; then
        failed_steps+=("$name")
        printf -- '---- FAILED: %s\n' "$name"
    fi
}
test_log="$(mktemp)"
# Every namespace a test makes is written here (tests/src/ns.rs), for the clean-up after.
FLEET_TEST_NS_FILE="$(mktemp)"
export FLEET_TEST_NS_FILE
cargo_test() {
    # Every test binary runs (--no-fail-fast); the log keeps each `test ... FAILED` line.
    # Three tests at a time on 2 cores: the end-to-end tests wait on brokers, leases and
    # timers more than they compute (at two, the CPU stood 43 % idle through the e2e binary;
    # three cut it from 767 s to 591 s on one machine). RUST_TEST_THREADS overrides.
    RUST_TEST_THREADS="${RUST_TEST_THREADS:-3}" \
        cargo test --workspace --no-fail-fast "$@" 2>&1 | tee "$test_log"
    return "${PIPESTATUS[0]}"
}
checked "configuration checks" bash ops/check-config.sh
# The habits CI enforces (issue 31): formatting (rustfmt.toml), clippy on every target, and
# the library docs without a broken or private link. Each fails the run on one warning.
checked "habits: cargo fmt --check" cargo fmt --all --check
checked "habits: cargo clippy -D warnings" cargo clippy --workspace --all-targets -- -D warnings
checked "habits: rustdoc -D warnings" env RUSTDOCFLAGS=-Dwarnings cargo doc --no-deps --workspace
step "cargo build --workspace --bins"
# The fault tests run fleet-worker and fleetctl as processes (killed, signalled).
cargo build --workspace --bins
checked "cargo test --workspace --no-fail-fast $*" cargo_test "$@"
# A test that fails (or panics) skips its own clean-up: its namespace's queues stay on the
# shared broker (hundreds after a bad run, and many quorum queues slow the node for the steps
# after). Every namespace this run's tests made that still has queues is deleted with
# fleetctl (from the broker's list, whatever Redis holds of it); other runs' are left alone.
# Each call is bounded (a frozen broker must not hold the run). Never fails the run.
step "leftover test namespaces"
queues=$(timeout 60 rabbitmqctl -q list_queues --no-table-headers name 2>/dev/null || echo "?")
if [ "$queues" = "?" ]; then
    echo "could not list the broker's queues (rabbitmqctl); nothing deleted"
else
    left=0
    while read -r ns; do
        grep -q "^$ns\." <<<"$queues" || continue
        left=$((left + 1))
        timeout 60 target/debug/fleetctl --namespace "$ns" delete-namespace --yes </dev/null >/dev/null 2>&1 ||
            echo "  could not delete namespace $ns"
    done < <(sort -u "$FLEET_TEST_NS_FILE")
    echo "$left of $(sort -u "$FLEET_TEST_NS_FILE" | wc -l) test namespaces had queues left; deleted"
fi
rm -f "$FLEET_TEST_NS_FILE"
# The Python client (clients/python) against a live fleet of the debug binaries: mypy --strict,
# then its tests (about 10 s).
checked "python client (clients/python)" env FLEET_BIN_DIR=target/debug bash ops/python-client-test.sh
checked "live metrics check" env FLEET_BIN_DIR=target/debug bash ops/check-metrics.sh
fuzz_seconds="${FLEET_FUZZ_SECONDS:-20}"
fuzz_build=""
if [ "$fuzz_seconds" != 0 ]; then
    # The fuzzers' instrumented build (about 5 min of CPU cold) runs beside the compose step,
    # which mostly waits on image builds and containers; at the lowest priority, so it only
    # takes what compose leaves. Its log is shown if it fails.
    fuzz_log="$(mktemp)"
    nice -n 19 bash ops/fuzz.sh 0 >"$fuzz_log" 2>&1 &
    fuzz_build=$!
fi
checked "compose deployment" env FLEET_BIN_DIR=target/debug bash ops/compose-test.sh
if [ -n "$fuzz_build" ]; then
    step "fuzz (${fuzz_seconds} s per target)"
    if ! wait "$fuzz_build"; then
        # A CI run's linker once died of SIGBUS ("ld terminated with signal 7") in this build,
        # which runs beside the compose step: the machine's state, not the code. The log, the
        # disk and the memory are shown, and the build is tried once more, alone; a second
        # failure fails the run.
        cat "$fuzz_log" >&2
        echo "ops/test.sh: the fuzzers' build failed beside the compose step; disk and memory now:" >&2
        df -h . /tmp >&2 || true
        free -m >&2 || true
        step "fuzz build, again alone"
        if ! bash ops/fuzz.sh 0 >"$fuzz_log" 2>&1; then
            cat "$fuzz_log" >&2
            echo "ops/test.sh: the fuzzers' build failed twice" >&2
            failed_steps+=("fuzz build")
        else
            checked "fuzz" bash ops/fuzz.sh "$fuzz_seconds"
        fi
    else
        cat "$fuzz_log"
        checked "fuzz" bash ops/fuzz.sh "$fuzz_seconds"
    fi
fi
if [ "${#failed_steps[@]}" -gt 0 ]; then
    printf '\n==== %s step(s) failed after %ss:\n' "${#failed_steps[@]}" "$((SECONDS - start))"
    printf '  %s\n' "${failed_steps[@]}"
    if grep -qE '^test .* \.\.\. FAILED$|^error: test failed' "$test_log"; then
        echo "failed tests (every binary ran):"
        grep -E '^test .* \.\.\. FAILED$|^error: test failed' "$test_log" | sed 's/^/  /'
    fi
    rm -f "$test_log"
    exit 1
fi
rm -f "$test_log"
printf '\n==== all tests passed in %ss\n' "$((SECONDS - start))"
