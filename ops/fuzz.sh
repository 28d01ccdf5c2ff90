#!/usr/bin/env bash
# Fuzzes fleet's hostile-input parsers with cargo-fuzz (libFuzzer): envelope parsing and
# validation, label selectors, the TOML/env config, the HTTP submit body.
#
#   ops/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     (default 60 s, every target)
#
# Fails on any crash (panic, overflow, stack exhaustion, timeout); the input that crashed is
# kept in fuzz/artifacts/<target>/ — turn it into a regression test. Seeds come from
# fuzz/corpus/<target>/ (read only); new inputs go to a temporary directory.
#
# cargo-fuzz needs nightly flags; on a stable toolchain RUSTC_BOOTSTRAP=1 enables them. The
# targets are built without a sanitizer (-s none): fleet forbids `unsafe` (workspace lint),
# so AddressSanitizer has nothing to find that a panic would not show, and the build is
# minutes shorter.
set -euo pipefail
cd "$(dirname "$0")/.."

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
    cargo install cargo-fuzz --locked
fi
export RUSTC_BOOTSTRAP=1

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

cd fuzz
start=$(date +%s)
cargo fuzz build -s none 2>&1 | tail -n 3 || { echo "fuzz.sh: build failed" >&2; exit 1; }
echo "fuzz.sh: built ${#targets[@]} targets in $(( $(date +%s) - start )) s"

failed=()
for t in "${targets[@]}"; do
    mkdir -p "$work/$t"
    echo "fuzz.sh: $t for ${duration} s"
    # -timeout: one input taking over 10 s is a hang; -rss_limit_mb bounds memory.
    if ! cargo fuzz run -s none "$t" "$work/$t" "corpus/$t" -- \
        -max_total_time="$duration" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        >"$work/$t.log" 2>&1; then
        failed+=("$t")
        tail -n 40 "$work/$t.log" >&2
    else
        grep -E "stat::number_of_executed_units|Done [0-9]+ runs" "$work/$t.log" | tail -n 2 || true
    fi
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz.sh: crashes in: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
    exit 1
fi
echo "fuzz.sh: all targets clean"
