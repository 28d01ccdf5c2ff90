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
