#!/usr/bin/env bash
# ops/check-config.sh — validate the operational configuration without running anything.
#
#   promtool check config   ops/prometheus/prometheus.yml (and the rule files it names)
#   promtool check rules    ops/prometheus/alerts.yml
#   promtool test rules     ops/prometheus/alerts.test.yml (alert unit tests)
#   docker-compose config   docker-compose.yml with the example env file, as on a clean checkout,
#                           plus: every bind-mounted file and every build's Dockerfile exist
#   Grafana                 dashboard.json is valid JSON with unique panel ids, and every PromQL
#                           query in it parses (promtool); provisioning YAML parses
#   Dockerfile              copies every workspace member named in Cargo.toml
#   ShellCheck              ops/*.sh and .ci/run
#
# Installs the tools first (ops/services.sh --tools-only). Runs every check, then exits
# non-zero if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."

bash ops/services.sh --tools-only

# Debian's python3 (a dependency of docker-compose, with PyYAML) rather than whatever
# python3 comes first on PATH.
PY=/usr/bin/python3
[ -x "$PY" ] || PY=python3

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

failed=()
check() {
    local name=$1
    shift
    printf '\n== %s\n' "$name"
    if "$@"; then
        printf -- '-- ok: %s\n' "$name"
    else
        printf -- '-- FAILED: %s\n' "$name"
        failed+=("$name")
    fi
}

compose_config() {
    # As on a clean checkout: the example env file, whatever the caller's environment says.
    env -u FLEET_ENV_FILE docker-compose -f docker-compose.yml config -q || return 1
    env -u FLEET_ENV_FILE docker-compose -f docker-compose.yml config >"$TMP/compose.yml" || return 1
    local missing=0 path
    # Bind mounts come out of `config` as absolute host paths.
    while IFS= read -r path; do
        if [ ! -e "$path" ]; then
            echo "bind-mounted path does not exist: $path"
            missing=1
        fi
    done < <(sed -n 's#^ *- \(/[^:]*\):/.*#\1#p' "$TMP/compose.yml")
    # A build's dockerfile is relative to its context (made absolute by `config`).
    "$PY" - "$TMP/compose.yml" <<'EOF' || missing=1
import os, sys, yaml
with open(sys.argv[1]) as f:
    services = yaml.safe_load(f)["services"]
bad = 0
for name, svc in services.items():
    build = svc.get("build")
    if build:
        path = os.path.join(build["context"], build.get("dockerfile", "Dockerfile"))
        if not os.path.isfile(path):
            print(f"{name}: dockerfile does not exist: {path}")
            bad = 1
sys.exit(bad)
EOF
    return "$missing"
}

dashboard() {
    # JSON, panel ids, and the queries as recording rules so that promtool parses them.
    "$PY" - ops/grafana/dashboard.json "$TMP/dashboard-rules.yml" <<'EOF' || return 1
import json, sys
path, out = sys.argv[1], sys.argv[2]
with open(path) as f:
    d = json.load(f)
errors = []
for key in ("title", "uid", "panels", "schemaVersion"):
    if key not in d:
        errors.append(f"missing top-level key {key!r}")
panels = d.get("panels", [])
for p in list(panels):
    panels.extend(p.get("panels", []))  # panels inside collapsed rows
ids = [p.get("id") for p in panels]
dups = {i for i in ids if ids.count(i) > 1}
if dups:
    errors.append(f"duplicate panel ids: {sorted(dups)}")
rules = []
for p in panels:
    if p.get("type") != "row" and "gridPos" not in p:
        errors.append(f"panel {p.get('title')!r} has no gridPos")
    for t in p.get("targets", []):
        expr = t.get("expr", "")
        if not expr:
            continue
        # Grafana's variables, replaced by values that PromQL accepts.
        expr = (expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
                .replace("$__range", "1h").replace("$group", ".*"))
        rules.append((f"dashboard:panel{p['id']}:{t.get('refId', 'A')}", expr))
if not rules:
    errors.append("no queries found")
with open(out, "w") as f:
    f.write("groups:\n  - name: dashboard\n    rules:\n")
    for name, expr in rules:
        f.write(f"      - record: {json.dumps(name)}\n        expr: {json.dumps(expr)}\n")
for e in errors:
    print(e)
print(f"{len(panels)} panels, {len(rules)} queries")
sys.exit(1 if errors else 0)
EOF
    promtool check rules "$TMP/dashboard-rules.yml" >/dev/null || {
        promtool check rules "$TMP/dashboard-rules.yml"
        return 1
    }
    "$PY" - ops/grafana/provisioning/datasources/*.yml ops/grafana/provisioning/dashboards/*.yml <<'EOF'
import sys, yaml
for p in sys.argv[1:]:
    with open(p) as f:
        doc = yaml.safe_load(f)
    assert isinstance(doc, dict) and doc.get("apiVersion") == 1, f"{p}: not a provisioning file"
print("provisioning files parse")
EOF
}

dockerfile_members() {
    # Every workspace member must be in the build context of ops/Dockerfile, or cargo
    # cannot load the workspace inside the image.
    "$PY" - Cargo.toml ops/Dockerfile <<'EOF'
import re, sys, tomllib
with open(sys.argv[1], "rb") as f:
    members = tomllib.load(f).get("workspace", {}).get("members", [])
with open(sys.argv[2]) as f:
    copied = set(re.findall(r"^COPY\s+(?:--\S+\s+)*(\S+)\s+\S+\s*$", f.read(), re.M))
missing = [m for m in members if m not in copied and m.rstrip("/") not in copied]
for m in missing:
    print(f"workspace member {m!r} is not copied by {sys.argv[2]}")
print(f"members: {members}")
sys.exit(1 if missing else 0)
EOF
}

readme_python_snippet() {
    # README's Python producer, run against a stand-in pika whose publish raises what the
    # broker would answer: accepted -> 0, a nack (full fleet) -> non-zero, the 404 of an
    # undeclared namespace -> non-zero. A refusal that exits 0 reads as success to a caller.
    "$PY" - README.md "$TMP" <<'EOF' || return 1
import os, re, subprocess, sys
readme, tmp = sys.argv[1], sys.argv[2]
text = open(readme).read()
m = re.search(r"From Python.*?```python\n(.*?)```", text, re.S)
if not m:
    sys.exit("README: no Python snippet after 'From Python'")
open(os.path.join(tmp, "snippet.py"), "w").write(m.group(1))
os.makedirs(os.path.join(tmp, "pika"), exist_ok=True)
open(os.path.join(tmp, "pika", "__init__.py"), "w").write("""
import os
class exceptions:
    class NackError(Exception): pass
    class UnroutableError(Exception): pass
    class ChannelClosedByBroker(Exception):
        def __init__(self, code, text):
            self.reply_code, self.reply_text = code, text
class URLParameters:
    def __init__(self, url): pass
class BasicProperties:
    def __init__(self, **kw): pass
class _Channel:
    def confirm_delivery(self): pass
    def basic_publish(self, **kw):
        answer = os.environ["FAKE_ANSWER"]
        if answer == "nack": raise exceptions.NackError()
        if answer == "404": raise exceptions.ChannelClosedByBroker(404, "NOT_FOUND - no exchange 'fleet.submit'")
class BlockingConnection:
    def __init__(self, params): pass
    def channel(self): return _Channel()
    def close(self): pass
""")
bad = 0
for answer, want_zero in [("ack", True), ("nack", False), ("404", False)]:
    env = dict(os.environ, FAKE_ANSWER=answer, PYTHONPATH=tmp)
    r = subprocess.run([sys.executable, os.path.join(tmp, "snippet.py")], env=env, capture_output=True, text=True)
    ok = (r.returncode == 0) == want_zero
    print(f"answer {answer}: exit {r.returncode} {'ok' if ok else 'WRONG'}: {(r.stdout + r.stderr).strip()}")
    bad |= not ok
sys.exit(bad)
EOF
}

readme_fleetctl_block() {
    # The fleetctl block of README lists each command line once (comments aside).
    "$PY" - README.md <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
m = re.search(r"## fleetctl\n\n```sh\n(.*?)```", text, re.S)
if not m:
    sys.exit("README: no fleetctl block")
lines = [l.split("  #")[0].strip() for l in m.group(1).splitlines() if l.strip()]
dups = sorted({l for l in lines if lines.count(l) > 1})
for l in dups:
    print(f"duplicated line: {l}")
sys.exit(1 if dups else 0)
EOF
}

one_build_features() {
    # One build (issue 29 item 9): the demo builds the three binaries alone, the tests the whole
    # workspace; both must resolve every dependency with the same features, or the test build
    # compiles tokio and everything above it a second time (60 s more on 2 cores). Compares
    # `cargo tree`'s feature lists of the two selections, crate by crate.
    cargo tree -p fleet-scheduler -p fleet-worker -p fleetctl -e normal,build -f '{p} [{f}]' \
        --prefix none >"$TMP/tree-demo.txt" || return 1
    cargo tree --workspace -e normal,build,dev -f '{p} [{f}]' --prefix none >"$TMP/tree-all.txt" ||
        return 1
    "$PY" - "$TMP/tree-demo.txt" "$TMP/tree-all.txt" <<'EOF'
import sys
def load(path):
    out = {}
    for line in open(path):
        line = line.strip()
        if not line or "[" not in line:
            continue
        name = line.split(" [")[0].replace(" (*)", "")
        feats = line[line.find("[") + 1 : line.rfind("]")]
        out.setdefault(name, set()).update(f for f in feats.split(",") if f)
    return out
demo, tests = load(sys.argv[1]), load(sys.argv[2])
bad = [
    f"{name}: the test build adds features {sorted(tests[name] - feats)}, the demo build {sorted(feats - tests[name])} (switch them on in shared/Cargo.toml)"
    for name, feats in sorted(demo.items())
    if name in tests and tests[name] != feats
]
for b in bad:
    print(b)
if not bad:
    print(f"{len(demo)} crates of the demo build resolve alike in the test build")
sys.exit(1 if bad else 0)
EOF
}

docs_match_code() {
    # The docs say what the code does (issue 29.11): every dead-letter reason of the code is in
    # README; the demo's and check-metrics' build and the demo's namespace as ops/lib.sh and
    # ops/demo.sh have them; the fuzz default of ops/test.sh; no change history in the quick
    # start; the builtin handlers paragraph outside the scaling section.
    "$PY" - <<'EOF'
import re, sys
readme = open("README.md").read()
ops = open("ops/README.md").read()
bad = []
state = open("shared/src/status/state.rs").read()
block = state[state.index('DeadReason, "dead-letter reason" {'):]
block = block[: block.index("\n    }\n")]
for word in re.findall(r'= "([a-z_]+)"', block):
    if f"`{word}`" not in readme:
        bad.append(f"README does not name the dead-letter reason `{word}`")
lib = open("ops/lib.sh").read()
if "cargo build \"${FLEET_BUILD_PACKAGES[@]}\" --bins" in lib and "--release" not in lib:
    for row in ("ops/demo.sh", "ops/check-metrics.sh"):
        line = next((l for l in ops.splitlines() if l.startswith(f"| `{row}`")), "")
        if "release" in line:
            bad.append(f"ops/README.md: {row} is said to make a release build (ops/lib.sh builds the dev profile)")
    if re.search(r"check-metrics.sh`\*\*[^\n]*builds the release", ops):
        bad.append("ops/README.md: check-metrics.sh is said to build release binaries")
demo = open("ops/demo.sh").read()
if re.search(r"^RANDOM_NS=1$", demo, re.M) and "default `demo`" in ops:
    bad.append("ops/README.md: the demo's default namespace is a random demo-<hex>, not `demo`")
test = open("ops/test.sh").read()
m = re.search(r"FLEET_FUZZ_SECONDS:-(\d+)", test)
if m and f"(default {m.group(1)};" not in ops:
    bad.append(f"ops/README.md: the fuzz step runs by default ({m.group(1)} s per target)")
if "--no-fail-fast" in test and "stops at the first failure" in ops:
    bad.append("ops/README.md: ops/test.sh runs every test binary (--no-fail-fast)")
quick = readme[readme.index("## The two commands"): readme.index("## Docker Compose")]
for phrase in ("used to", "no longer", "previously", "now "):
    if phrase in quick:
        bad.append(f"README quick start holds change history ({phrase!r})")
scale = readme[readme.index("### Past one machine"): readme.index("## Security")]
if "Builtin handlers" in scale:
    bad.append("README: the builtin handlers paragraph sits in the scaling section")
for b in bad:
    print(b)
sys.exit(1 if bad else 0)
EOF
}

check "docs match the code" docs_match_code
check "one build: the demo's crates resolve alike in the test build" one_build_features
check "README Python producer exits non-zero on a refusal" readme_python_snippet
check "README fleetctl block has no duplicate line" readme_fleetctl_block
check "promtool check config" promtool check config ops/prometheus/prometheus.yml
check "promtool check rules" promtool check rules ops/prometheus/alerts.yml
check "promtool test rules" promtool test rules ops/prometheus/alerts.test.yml
check "promtool check rules (failover)" promtool check rules ops/prometheus/failover.yml
check "promtool test rules (failover)" promtool test rules ops/prometheus/failover.test.yml
check "docker-compose config" compose_config
check "grafana dashboard" dashboard
check "Dockerfile copies the workspace" dockerfile_members
check "shellcheck" shellcheck -S warning ops/*.sh .ci/run

echo
if [ "${#failed[@]}" -gt 0 ]; then
    echo "check-config: ${#failed[@]} check(s) failed: ${failed[*]}"
    exit 1
fi
echo "check-config: all checks passed"
