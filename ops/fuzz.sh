#!/usr/bin/env bash
# Fuzzes fleet's hostile-input parsers with cargo-fuzz (libFuzzer): envelope parsing and
# validation, label selectors, the TOML/env config, the HTTP submit body.
#
#   ops/fuzz.sh [--release] [--binaries] [SECONDS_PER_TARGET] [TARGET...]
#                                         (default 60 s, every target; 0 builds only)
#
#   --release    optimised build (opt-level 3, one codegen unit, as `cargo fuzz build`
#                defaults to): more executions per second, but its cold build took ~21 min
#                on a 2-core machine — for long runs, not for CI
#   --binaries   the `config` target also checks the scheduler's and the worker's own settings
#                (SchedulerConfig/WorkerConfig::from_settings; cargo feature `binaries`: ~30
#                more crates, among them reqwest and chrono-tz); without it, the fleet lib's
#                common settings only
#
# Fails on any crash (panic, overflow, stack exhaustion, a 10 s timeout, 2 GB of memory); the
# input that crashed is kept in fuzz/artifacts/<target>/ — turn it into a regression test in
# the crate that owns the parser. Seeds come from fuzz/corpus/<target>/ (read only); new
# inputs go to a temporary directory.
#
# The default build is `cargo fuzz build --dev`: no optimisation but for libFuzzer's own C++
# (see fuzz/Cargo.toml), debug assertions and overflow checks on, coverage instrumentation as
# always; about 9 min of CPU cold (the fleet lib and its dependencies). No sanitizer (-s none):
# fleet forbids `unsafe` (workspace lint), so AddressSanitizer has nothing to find that a
# panic would not show. It goes to fuzz/target (fuzz/Cargo.lock pins the versions), and a warm fuzz/target is
# not rebuilt: `cargo fuzz run` is given the same flags as the build. cargo-fuzz needs nightly
# flags; on a stable toolchain RUSTC_BOOTSTRAP=1 enables them. cargo-fuzz itself is installed
# (`cargo install --locked`, about 2 min of CPU) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

build=(--dev -s none)
while [ $# -gt 0 ]; do
    case "$1" in
        --release) build=(-s none); shift ;;
        --binaries) build+=(--features binaries); shift ;;
        *) break ;;
    esac
done
duration="${1:-60}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(envelope selector config submit_body)
fi
case "$duration" in
    ''|*[!0-9]*) echo "fuzz.sh: duration must be whole seconds, got '$duration'" >&2; exit 2 ;;
esac

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz.sh: installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked --version '^0.13'
fi
export RUSTC_BOOTSTRAP=1

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

cd fuzz
start=$SECONDS
if ! cargo fuzz build "${build[@]}" >"$work/build.log" 2>&1; then
    tail -n 40 "$work/build.log" >&2
    echo "fuzz.sh: build failed" >&2
    exit 1
fi
echo "fuzz.sh: built the targets (cargo fuzz build ${build[*]}) in $((SECONDS - start)) s"
[ "$duration" = 0 ] && exit 0

failed=()
for t in "${targets[@]}"; do
    mkdir -p "$work/$t"
    echo "fuzz.sh: $t for ${duration} s"
    # -timeout: one input taking over 10 s is a hang; -rss_limit_mb bounds memory.
    if ! cargo fuzz run "${build[@]}" "$t" "$work/$t" "corpus/$t" -- \
        -max_total_time="$duration" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        >"$work/$t.log" 2>&1; then
        failed+=("$t")
        tail -n 40 "$work/$t.log" >&2
    else
        grep -E "stat::number_of_executed_units|stat::new_units_added" "$work/$t.log" | tr '\n' ' ' || true
        echo
    fi
done
echo "fuzz.sh: done in $((SECONDS - start)) s"
if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz.sh: crashes in: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
    exit 1
fi
echo "fuzz.sh: all targets clean"
