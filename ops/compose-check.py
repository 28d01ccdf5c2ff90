#!/usr/bin/env python3
"""ops/compose-check.py — the checks ops/compose-test.sh makes on a running compose project.

Standard library only (Debian's python3, which docker-compose brings). Every wait has a
deadline; a failed check prints why and exits 1.

  workers     --api URL --hosts H1,H2,... [--timeout S]
      Waits until GET /v1/workers lists, for each container hostname H, exactly one worker
      whose id is `H-<6 hex>` (the id a worker gives itself when FLEET_WORKER_ID is unset)
      in state `active`. Prints `hostname worker-id` lines.
  tasks       --api URL --prefix P --count N [--hosts H1,...] [--min-share F] [--timeout S]
      Waits until the tasks P-1 ... P-N have all ended (GET /v1/tasks/{id}), then checks that
      each one ran exactly once: it succeeded on its first attempt (`attempt` = 1, an integer)
      on a worker, and its attempt history (`attempts`) is that one run and nothing else — no
      failed, lost or retried run beside it. With --hosts, every
      task must have run on one of those containers and each container must have run at
      least F (a fraction, default 0) of the N tasks. Prints the count per container.
  states      --api URL --prefix P --count N
      Prints how many of the tasks P-1 ... P-N are in each state right now (`unknown`: no
      status yet), as `state=count` words, without waiting.
  prometheus  --url URL --jobs J1,J2,... --targets N --completed C [--timeout S]
      Waits until Prometheus has exactly N active scrape targets, every one with health `up`
      and every `up` sample equal to 1, the jobs J1,... among them, and until
      sum(fleet_tasks_completed_total{outcome="succeeded"}) equals C (user tasks only: the
      scheduler's health probes are counted in fleet_probes_completed_total) and so does the
      sum over every outcome: the workers ran C attempts in all, one per task.

The API token comes from FLEET_API_TOKEN (sent as `Authorization: Bearer`, when set).
"""

import argparse
import http.client
import json
import os
import sys
import time
import urllib.parse
from collections import Counter


class CheckFailed(Exception):
    pass


class Http:
    """One keep-alive connection to a base URL; reconnects after a broken connection."""

    def __init__(self, base, token=None):
        u = urllib.parse.urlsplit(base)
        if u.scheme != "http" or not u.hostname:
            raise CheckFailed(f"not an http:// URL: {base}")
        self.host, self.port = u.hostname, u.port or 80
        self.headers = {"Accept": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.conn = None

    def get(self, path):
        """(status, parsed JSON or None); status 0 when nothing answered."""
        for _ in range(2):
            try:
                if self.conn is None:
                    self.conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
                self.conn.request("GET", path, headers=self.headers)
                r = self.conn.getresponse()
                body = r.read()
                try:
                    return r.status, json.loads(body) if body else None
                except ValueError:
                    return r.status, None
            except (OSError, http.client.HTTPException):
                if self.conn is not None:
                    self.conn.close()
                self.conn = None
        return 0, None


def wait_until(what, timeout, probe, interval=1.0):
    """Calls probe() until it returns (True, detail) or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        ok, detail = probe()
        if ok:
            return detail
        if time.monotonic() >= deadline:
            raise CheckFailed(f"{what}: not reached within {timeout:.0f} s (last: {detail})")
        time.sleep(interval)


def worker_host(worker_id):
    """The hostname part of `<hostname>-<6 hex>`."""
    return worker_id.rsplit("-", 1)[0]


def cmd_workers(a):
    api = Http(a.api, os.environ.get("FLEET_API_TOKEN"))
    hosts = [h for h in a.hosts.split(",") if h]

    def probe():
        status, body = api.get("/v1/workers")
        if status != 200 or not isinstance(body, list):
            return False, f"GET /v1/workers answered {status}"
        found = {}
        for w in body:
            h = worker_host(w.get("id", ""))
            if h in hosts and w.get("state") == "active":
                found.setdefault(h, []).append(w["id"])
        missing = [h for h in hosts if len(found.get(h, [])) != 1]
        if missing:
            return False, f"no single active worker yet for {missing}"
        return True, {h: found[h][0] for h in hosts}

    ids = wait_until("workers registered", a.timeout, probe)
    for h in hosts:
        print(f"{h} {ids[h]}")


def cmd_tasks(a):
    api = Http(a.api, os.environ.get("FLEET_API_TOKEN"))
    ids = [f"{a.prefix}-{i}" for i in range(1, a.count + 1)]
    terminal = ("succeeded", "dead", "expired")
    done = {}

    def probe():
        for tid in ids:
            if tid in done:
                continue
            status, body = api.get(f"/v1/tasks/{urllib.parse.quote(tid)}")
            if status == 200 and isinstance(body, dict) and body.get("state") in terminal:
                done[tid] = body
            elif status not in (200, 404):
                return False, f"GET /v1/tasks/{tid} answered {status}"
        return len(done) == len(ids), f"{len(done)} of {len(ids)} ended"

    wait_until(f"tasks {a.prefix}-*", a.timeout, probe, interval=0.5)
    bad = [(t, s.get("state"), s.get("attempt"), s.get("worker")) for t, s in done.items()
           if s.get("state") != "succeeded" or s.get("attempt") != 1 or not s.get("worker")]
    if bad:
        raise CheckFailed(f"{len(bad)} task(s) did not succeed once on a worker, e.g. {bad[:5]}")
    # Runs, counted: the attempt history holds every run a worker ended (failed, lost, retried,
    # succeeded); exactly once is one entry, the success, on the status's worker.
    runs = {t: s.get("attempts") for t, s in done.items()}
    twice = [(t, r) for t, r in runs.items()
             if not isinstance(r, list) or len(r) != 1
             or r[0].get("outcome") != "succeeded" or r[0].get("attempt") != 1
             or r[0].get("worker") != done[t].get("worker")]
    if twice:
        raise CheckFailed(f"{len(twice)} task(s) did not run exactly once, e.g. {twice[:3]}")
    per_host = Counter(worker_host(s["worker"]) for s in done.values())
    hosts = [h for h in (a.hosts or "").split(",") if h]
    for h, n in sorted(per_host.items(), key=lambda kv: -kv[1]):
        print(f"  {h}: {n} tasks")
    if hosts:
        strays = {h: n for h, n in per_host.items() if h not in hosts}
        if strays:
            raise CheckFailed(f"tasks ran outside the expected containers: {strays}")
        floor = a.min_share * a.count
        short = {h: per_host.get(h, 0) for h in hosts if per_host.get(h, 0) < max(floor, 1)}
        if short:
            raise CheckFailed(f"containers with fewer than {max(floor, 1):.0f} tasks: {short}")
    print(f"{a.count} tasks {a.prefix}-1..{a.count}: each ran once (1 attempt, succeeded) on {len(per_host)} worker(s)")


def cmd_states(a):
    api = Http(a.api, os.environ.get("FLEET_API_TOKEN"))
    states = Counter()
    for i in range(1, a.count + 1):
        status, body = api.get(f"/v1/tasks/{urllib.parse.quote(f'{a.prefix}-{i}')}")
        if status == 200 and isinstance(body, dict):
            states[body.get("state", "unknown")] += 1
        elif status == 404:
            states["unknown"] += 1
        else:
            raise CheckFailed(f"GET /v1/tasks/{a.prefix}-{i} answered {status}")
    print(" ".join(f"{k}={v}" for k, v in sorted(states.items())))


def cmd_prometheus(a):
    prom = Http(a.url)
    jobs = {j for j in a.jobs.split(",") if j}

    def query(expr):
        status, body = prom.get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        if status != 200 or not isinstance(body, dict) or body.get("status") != "success":
            return None
        return body["data"]["result"]

    def targets_up():
        status, body = prom.get("/api/v1/targets?state=active")
        if status != 200 or not isinstance(body, dict):
            return False, f"GET /api/v1/targets answered {status}"
        active = body["data"]["activeTargets"]
        down = [(t["labels"].get("job"), t["labels"].get("instance"), t["health"], t.get("lastError"))
                for t in active if t["health"] != "up"]
        seen = {t["labels"].get("job") for t in active}
        if len(active) != a.targets or down or not jobs <= seen:
            return False, f"{len(active)} active targets (want {a.targets}), not up: {down}, jobs {sorted(seen)}"
        up = query("up")
        if up is None or len(up) != a.targets or any(s["value"][1] != "1" for s in up):
            return False, f"up samples: {up}"
        return True, active

    completed_expr = 'sum(fleet_tasks_completed_total{outcome="succeeded"})'

    runs_expr = "sum(fleet_tasks_completed_total)"

    def completed():
        r = query(completed_expr)
        value = int(float(r[0]["value"][1])) if r else None
        return value == a.completed, f"{completed_expr} = {value}"

    def runs():
        # Every attempt a worker ended, whatever its outcome: C runs for C tasks.
        r = query(runs_expr)
        value = int(float(r[0]["value"][1])) if r else None
        return value == a.completed, f"{runs_expr} = {value} (runs of every outcome)"

    active = wait_until("scrape targets up", a.timeout, targets_up, interval=2)
    for t in sorted(active, key=lambda t: (t["labels"]["job"], t["labels"]["instance"])):
        service = t["labels"].get("service", "")
        print(f"  target {t['labels']['job']:<16} {t['labels']['instance']:<24} {service:<11} up")
    print(wait_until("completed tasks in Prometheus", a.timeout, completed, interval=2))
    ok, what = runs()
    if not ok:
        raise CheckFailed(f"the workers ran other attempts than one per task: {what}")
    print(what)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("workers")
    w.add_argument("--api", required=True)
    w.add_argument("--hosts", required=True)
    w.add_argument("--timeout", type=float, default=120)
    t = sub.add_parser("tasks")
    t.add_argument("--api", required=True)
    t.add_argument("--prefix", required=True)
    t.add_argument("--count", type=int, required=True)
    t.add_argument("--hosts")
    t.add_argument("--min-share", type=float, default=0.0)
    t.add_argument("--timeout", type=float, default=300)
    st = sub.add_parser("states")
    st.add_argument("--api", required=True)
    st.add_argument("--prefix", required=True)
    st.add_argument("--count", type=int, required=True)
    m = sub.add_parser("prometheus")
    m.add_argument("--url", required=True)
    m.add_argument("--jobs", required=True)
    m.add_argument("--targets", type=int, required=True)
    m.add_argument("--completed", type=int, required=True)
    m.add_argument("--timeout", type=float, default=120)
    a = p.parse_args()
    try:
        {"workers": cmd_workers, "tasks": cmd_tasks, "states": cmd_states,
         "prometheus": cmd_prometheus}[a.cmd](a)
    except CheckFailed as e:
        print(f"[compose-check] FAILED: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
