// fleet console: a plain ES module, no framework, no build step. Every figure comes from the
// scheduler's /v1 API with the operator's bearer token; the page refreshes every 2 s.

const REFRESH_MS = 2000;
const TOKEN_KEY = "fleet.console.token";
const VIEWS = ["overview", "groups", "workers", "dead", "schedules", "task", "batch", "tasks", "keys", "audit"];

const $ = (sel) => document.querySelector(sel);

/** Builds an element: h("td", {class: "num", dataset: {k: "x"}}, "text", child...). Text is
 *  always set as text, never parsed as HTML (dead letters carry untrusted strings). */
function h(tag, attrs = {}, ...children) {
  const svg = ["svg", "polyline", "line", "text", "g"].includes(tag);
  const el = svg ? document.createElementNS("http://www.w3.org/2000/svg", tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "dataset") Object.assign(el.dataset, v);
    else if (k === "on") for (const [ev, fn] of Object.entries(v)) el.addEventListener(ev, fn);
    else if (k === "vars") for (const [p, val] of Object.entries(v)) el.style.setProperty(p, val);
    else if (k === "checked" || k === "disabled" || k === "value") el[k] = v;
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

// ---------------------------------------------------------------- token and API

const token = {
  get() { return sessionStorage.getItem(TOKEN_KEY) || localStorage.getItem(TOKEN_KEY) || ""; },
  set(t, remember) {
    this.clear();
    (remember ? localStorage : sessionStorage).setItem(TOKEN_KEY, t);
  },
  clear() { sessionStorage.removeItem(TOKEN_KEY); localStorage.removeItem(TOKEN_KEY); },
};

class Unauthorized extends Error {}
class Unreachable extends Error {}
/** The scheduler answers, but its figures are old: it cannot read the fleet. */
class Stale extends Error {}

/** Calls the API. Resolves to {status, body}; throws Unauthorized on 401 and Unreachable when
 *  the scheduler does not answer (or answers 502/503/504 from a proxy). */
async function api(path, { method = "GET", body } = {}) {
  const headers = { Accept: "application/json" };
  const t = token.get();
  if (t) headers.Authorization = `Bearer ${t}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let resp;
  try {
    resp = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body), cache: "no-store" });
  } catch (e) {
    throw new Unreachable(String(e));
  }
  if (resp.status === 401) throw new Unauthorized();
  let data = null;
  try { data = await resp.json(); } catch { data = null; }
  if ([502, 504].includes(resp.status)) throw new Unreachable(`HTTP ${resp.status}`);
  return { status: resp.status, body: data };
}

/** Calls the API for an action. A scheduler that does not answer (or a proxy's 502/504, or
 *  the scheduler's own 504 "recorded, not applied yet") leaves the outcome unknown: the notice
 *  says so, instead of nothing at all. Resolves to null then. */
async function actionApi(what, path, opts) {
  try {
    return await api(path, opts);
  } catch (e) {
    if (e instanceof Unauthorized) {
      token.clear();
      showLogin("That token was refused (401). Enter a valid token.");
      return null;
    }
    notice(`${what}: the scheduler did not answer (${e.message}); whether it happened is unknown — look before trying again.`, false);
    refreshNow();
    return null;
  }
}

function problem(r) {
  if (r.status === 403) return "your token does not have the role this needs (admin acts, read looks)";
  return (r.body && (r.body.detail || r.body.error)) || `HTTP ${r.status}`;
}

// ---------------------------------------------------------------- formatting

const fmt = {
  n(v) { return v === undefined || v === null ? "–" : Number(v).toLocaleString("en-US"); },
  pct(v) { return v === undefined || v === null ? "–" : `${(v * 100).toFixed(0)}%`; },
  secs(s) {
    if (s === undefined || s === null || Number.isNaN(s)) return "–";
    if (s < 1) return `${Math.round(s * 1000)} ms`;
    if (s < 120) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
    if (s < 7200) return `${Math.round(s / 60)} min`;
    return `${(s / 3600).toFixed(1)} h`;
  },
  rate(v) { return v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2); },
  labels(l) {
    if (!l || typeof l !== "object") return "–";
    const pairs = Object.entries(l).map(([k, v]) => `${k}=${v}`);
    return pairs.length ? pairs.join(", ") : "(none)";
  },
  /** An RFC 3339 UTC time from the API, shown as "2026-11-30 10:48:01.123 UTC". */
  iso(t) { return typeof t === "string" && t ? t.replace("T", " ").replace(/Z$/, " UTC") : "–"; },
  when(ms) {
    if (!ms) return "–";
    const n = Number(ms);
    return Number.isFinite(n) ? new Date(n).toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC") : String(ms);
  },
};

function lanes(normal, critical) {
  return h("span", { class: "lanes" }, String(normal), h("span", { class: "sep" }, "|"), String(critical));
}

/** A <time> element: the API's exact RFC 3339 value in `datetime`, readable text inside. */
function timeEl(t) {
  return typeof t === "string" && t ? h("time", { datetime: t }, fmt.iso(t)) : "–";
}

// ---------------------------------------------------------------- confirm and notices

function confirmAction(text) {
  const d = $("#confirm");
  $("#confirm-text").textContent = text;
  return new Promise((resolve) => {
    d.addEventListener("close", () => resolve(d.returnValue === "ok"), { once: true });
    d.returnValue = "";
    d.showModal();
  });
}

function notice(text, ok = true) {
  const n = $("#notice");
  n.textContent = text;
  n.className = `banner ${ok ? "ok" : "err"}`;
  n.hidden = false;
  clearTimeout(notice.timer);
  notice.timer = setTimeout(() => { n.hidden = true; }, 8000);
}

// ---------------------------------------------------------------- charts

/** A small line chart of `defs` ([{key, label, color, rate}]) over the last `window` seconds.
 *  `rate` divides a point's count by its interval; otherwise the value is drawn as is. */
function chart(el, points, defs, windowS, unitFmt) {
  const W = 600, H = 120, L = 40, B = 16;
  const now = Date.now();
  // The last 15 minutes, or since the scheduler started when its history is shorter.
  const first = points.length ? points[0].at_ms - points[0].seconds * 1000 : now;
  const from = Math.max(now - windowS * 1000, Math.min(first, now - 60000));
  const span = now - from;
  const value = (p, d) => {
    const v = p[d.key];
    if (v === null || v === undefined) return null;
    return d.rate ? (p.seconds > 0 ? v / p.seconds : 0) : v;
  };
  let max = 0;
  for (const p of points) for (const d of defs) { const v = value(p, d); if (v !== null) max = Math.max(max, v); }
  if (max === 0) max = 1;
  const x = (t) => L + ((t - from) / span) * (W - L);
  const y = (v) => (H - B) - (v / max) * (H - B - 6);
  const svg = h("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img" },
    h("line", { class: "axis", x1: L, y1: H - B, x2: W, y2: H - B }),
    h("text", { x: 2, y: 10 }, unitFmt(max)),
    h("text", { x: 2, y: H - B }, "0"),
    h("text", { x: L, y: H - 2 }, `−${fmt.secs(span / 1000)}`),
    h("text", { x: W - 24, y: H - 2 }, "now"));
  for (const d of defs) {
    const pts = points.filter((p) => p.at_ms >= from && value(p, d) !== null).map((p) => `${x(p.at_ms).toFixed(1)},${y(value(p, d)).toFixed(1)}`);
    if (pts.length) svg.append(h("polyline", { points: pts.join(" "), fill: "none", stroke: d.color, "stroke-width": 1.5, "vector-effect": "non-scaling-stroke" }));
  }
  const legend = h("div", { class: "legend" }, defs.map((d) => {
    // The latest interval's figure; for a quantile, the latest interval that had samples.
    const last = d.rate ? points[points.length - 1] : [...points].reverse().find((p) => value(p, d) !== null);
    const v = last ? value(last, d) : null;
    return h("span", { vars: { "--sw": d.color }, dataset: { series: d.key } }, `${d.label} `, h("b", {}, v === null ? "–" : unitFmt(v)));
  }));
  el.replaceChildren(svg, legend);
}

const css = (v) => getComputedStyle(document.documentElement).getPropertyValue(v).trim();

// ---------------------------------------------------------------- views

async function renderOverview() {
  const [p, s] = await Promise.all([api("/v1/pressure"), api("/v1/series")]);
  if (p.status !== 200) throw new Error(problem(p));
  const pr = p.body;
  const badge = $("#pressure-state");
  badge.textContent = pr.state;
  badge.className = `badge ${pr.state}`;
  $("#p-since").textContent = pr.since_ms ? `since ${new Date(pr.since_ms).toISOString().slice(11, 19)} UTC` : "";
  $("#p-intake").textContent = { green: "open", yellow: "throttled", red: "closed" }[pr.state] ?? pr.state;
  const max = pr.thresholds ? pr.thresholds.max_pending : null;
  $("#p-waiting").textContent = max ? `${fmt.n(pr.waiting)} / ${fmt.n(max)}` : fmt.n(pr.waiting);
  $("#p-pending").textContent = fmt.n(pr.pending);
  $("#p-load").textContent = `${fmt.n(pr.running)} / ${fmt.n(pr.capacity)} (${fmt.pct(pr.load)}, ${pr.load_level ?? "–"})`;
  $("#p-ingress").textContent = fmt.n(pr.ingress_backlog);
  $("#p-parked").textContent = fmt.n(pr.parked);
  $("#p-reserved").textContent = fmt.n(pr.reserved);
  if (pr.stale) {
    const age = pr.age_ms === null || pr.age_ms === undefined ? "since it started" : `for ${fmt.secs(pr.age_ms / 1000)}`;
    throw new Stale(`no fresh sample of the fleet ${age}: the scheduler cannot read RabbitMQ or Redis; these are the last figures it had`);
  }
  if (s.status !== 200) return;
  const pts = s.body.points || [];
  const win = s.body.window_seconds || 900;
  chart($("#chart-throughput"), pts, [
    { key: "submitted", label: "submitted", color: css("--c1"), rate: true },
    { key: "dispatched", label: "dispatched", color: css("--c2"), rate: true },
    { key: "succeeded", label: "succeeded", color: css("--c3"), rate: true },
    { key: "failed", label: "failed", color: css("--c4"), rate: true },
  ], win, (v) => `${fmt.rate(v)}/s`);
  chart($("#chart-wait"), pts, [
    { key: "wait_p50", label: "p50", color: css("--c1") },
    { key: "wait_p99", label: "p99", color: css("--c4") },
  ], win, fmt.secs);
  chart($("#chart-refused"), pts, [{ key: "refused", label: "refused", color: css("--c4"), rate: true }], win, (v) => `${fmt.rate(v)}/s`);
}

function probeCell(g) {
  if (g.probe_ok === undefined) return h("span", { class: "muted" }, "–");
  if (g.probe_ok) return h("span", { class: "badge ok" }, `ok ${g.probe_seconds != null ? fmt.secs(g.probe_seconds) : ""}`.trim());
  return h("span", { class: "badge fail" }, `failing ×${g.probe_consecutive_failures ?? "?"}`);
}

async function renderGroups() {
  const r = await api("/v1/groups");
  if (r.status !== 200) throw new Error(problem(r));
  const groups = [...r.body].sort((a, b) => (b.backlog ?? 0) - (a.backlog ?? 0) || a.group.localeCompare(b.group));
  const rows = groups.map((g) => h("tr", { dataset: { group: g.group } },
    h("td", { class: "mono" }, tasksLink(g.group, { group: g.group })),
    h("td", { dataset: { k: "labels" } }, fmt.labels(g.labels)),
    h("td", { class: "num", dataset: { k: "workers" } }, String(g.workers)),
    h("td", { dataset: { k: "capacity" } }, lanes(g.capacity, g.critical_capacity)),
    h("td", { dataset: { k: "load" } }, lanes(g.load, g.critical_load)),
    h("td", { dataset: { k: "reserved" } }, lanes(g.reserved, g.critical_reserved)),
    h("td", { class: "num", dataset: { k: "backlog" } }, g.backlog === undefined ? "–" : String(g.backlog)),
    h("td", { dataset: { k: "queued" } }, lanes(g.queued ?? "–", g.queued_critical ?? "–")),
    h("td", { dataset: { k: "parked" } }, lanes(g.parked ?? "–", g.parked_critical ?? "–")),
    h("td", { class: "num", dataset: { k: "oldest" } }, g.oldest_task_age_seconds === undefined ? "–" : fmt.secs(g.oldest_task_age_seconds)),
    h("td", { dataset: { k: "as-of" } }, g.sampled_at ? timeEl(g.sampled_at) : "–"),
    h("td", { dataset: { k: "probe" } }, probeCell(g)),
    h("td", { dataset: { k: "pause" } }, pauseCell(g))));
  $("#groups-table tbody").replaceChildren(...(rows.length ? rows : [h("tr", { class: "empty" }, h("td", { colspan: 13 }, "No groups registered."))]));
}

async function drain(id) {
  if (!(await confirmAction(`Drain worker ${id}? It finishes its running tasks, takes no new ones and leaves the fleet.`))) return;
  const r = await actionApi(`Drain ${id}`, `/v1/workers/${encodeURIComponent(id)}/drain`, { method: "POST", body: {} });
  if (!r) return;
  if (r.status === 202) notice(`Worker ${id} is draining (was ${r.body.previous_state}).`);
  else notice(`Cannot drain ${id}: ${problem(r)}`, false);
  refreshNow();
}

async function renderWorkers() {
  const r = await api("/v1/workers");
  if (r.status !== 200) throw new Error(problem(r));
  const rows = r.body.map((w) => {
    const skew = w.clock_skew_ms ?? w.skew_ms;
    return h("tr", { dataset: { worker: w.id } },
      h("td", { class: "mono" }, w.id),
      h("td", { dataset: { k: "state" } }, h("span", { class: `badge ${w.state}` }, w.state)),
      h("td", { class: "mono" }, tasksLink(w.group, { group: w.group })),
      h("td", {}, fmt.labels(w.labels)),
      h("td", { dataset: { k: "running" } }, lanes(`${w.running}/${w.capacity}`, `${w.running_critical}/${w.critical_capacity}`)),
      h("td", { class: "num", dataset: { k: "heartbeat" } }, `${fmt.secs(w.last_heartbeat_ms_ago / 1000)} ago`),
      h("td", { class: "num", dataset: { k: "succeeded" } }, fmt.n(w.succeeded)),
      h("td", { class: "num", dataset: { k: "failed" } }, fmt.n(w.failed)),
      h("td", { class: "num", dataset: { k: "unrecorded" } }, fmt.n(w.unrecorded ?? 0)),
      h("td", { class: "num", dataset: { k: "skew" } }, skew === undefined || skew === null ? "–" : `${skew} ms`),
      h("td", {}, h("button", { class: "small drain", disabled: w.state === "draining", on: { click: () => drain(w.id) } }, "Drain")));
  });
  $("#workers-table tbody").replaceChildren(...(rows.length ? rows : [h("tr", { class: "empty" }, h("td", { colspan: 11 }, "No workers registered."))]));
}

// Dead letters: the selection survives refreshes.
const dead = { selected: new Set(), shown: [] };

function fillSelect(sel, counts) {
  const current = sel.value;
  const opts = [h("option", { value: "" }, "any")];
  for (const [k, n] of Object.entries(counts || {})) opts.push(h("option", { value: k }, `${k} (${n})`));
  if (current && !(current in (counts || {}))) opts.push(h("option", { value: current }, `${current} (0)`));
  sel.replaceChildren(...opts);
  sel.value = current;
}

async function replay(body, what) {
  if (!(await confirmAction(`Replay ${what}? Each task is submitted again as new, attempt count reset.`))) return;
  const r = await actionApi(`Replay ${what}`, "/v1/dead/replay", { method: "POST", body });
  if (!r) return;
  if (r.status !== 200) { notice(`Replay failed: ${problem(r)}`, false); return; }
  const b = r.body;
  const extra = [b.failed.length ? `${b.failed.length} failed (${b.failed.map(([id, why]) => `${id}: ${why}`).join("; ")})` : "", b.missing.length ? `${b.missing.length} no longer dead` : ""].filter(Boolean).join(", ");
  notice(`Replayed ${b.replayed.length}${extra ? `; ${extra}` : ""}.`, b.failed.length === 0);
  for (const id of b.replayed) dead.selected.delete(id);
  refreshNow();
}

function showEnvelope(d) {
  $("#envelope-title").textContent = `Dead letter ${d.id}`;
  const meta = { reason: d.reason, detail: d.detail, attempts: d.attempts, last_worker: d.worker, dead_at: fmt.when(d.dead_at_ms), replayable: d.replayable };
  $("#envelope-body").textContent = `${JSON.stringify(meta, null, 2)}\n\nenvelope:\n${JSON.stringify(d.envelope, null, 2)}`;
  $("#envelope").showModal();
}

async function renderDead() {
  const reason = $("#dead-reason").value, kind = $("#dead-kind").value;
  const q = new URLSearchParams({ reason, kind, scan: "500" });
  const r = await api(`/v1/dead?${q}`);
  if (r.status !== 200) throw new Error(problem(r));
  const b = r.body;
  fillSelect($("#dead-reason"), b.reasons);
  fillSelect($("#dead-kind"), b.kinds);
  dead.shown = b.letters;
  const ids = new Set(b.letters.map((d) => d.id));
  for (const id of [...dead.selected]) if (!ids.has(id)) dead.selected.delete(id);
  const now = Date.now();
  const rows = b.letters.map((d) => h("tr", { dataset: { task: d.id } },
    h("td", {}, h("input", { type: "checkbox", class: "pick", checked: dead.selected.has(d.id), disabled: !d.replayable, "aria-label": `select ${d.id}`,
      on: { change: (e) => { if (e.target.checked) dead.selected.add(d.id); else dead.selected.delete(d.id); updateDeadButtons(); } } })),
    h("td", { class: "mono" }, d.id),
    h("td", { dataset: { k: "kind" } }, d.kind),
    h("td", { dataset: { k: "reason" } }, h("span", { class: "badge dead" }, d.reason)),
    h("td", { class: "detail", dataset: { k: "detail" } }, d.detail),
    h("td", { class: "num", dataset: { k: "attempts" } }, d.attempts ?? "–"),
    h("td", { class: "mono", dataset: { k: "worker" } }, d.worker ?? "–"),
    h("td", { class: "num", dataset: { k: "age" } }, d.dead_at_ms ? fmt.secs(Math.max(0, now - d.dead_at_ms) / 1000) : "–"),
    h("td", {},
      h("button", { class: "small view", on: { click: () => showEnvelope(d) } }, "View"), " ",
      h("button", { class: "small replay", disabled: !d.replayable, on: { click: () => replay({ ids: [d.id] }, `task ${d.id}`) } }, "Replay"))));
  $("#dead-table tbody").replaceChildren(...(rows.length ? rows : [h("tr", { class: "empty" }, h("td", { colspan: 9 }, b.depth ? "No dead letter matches the filter." : "No dead letters."))]));
  const more = b.depth > b.scanned ? ` (first ${b.scanned} of ${b.depth} read)` : "";
  $("#dead-count").textContent = `${b.letters.length} shown, ${b.depth} in the dead queue${more}`;
  updateDeadButtons();
}

function updateDeadButtons() {
  const n = dead.selected.size;
  const btn = $("#dead-replay-selected");
  btn.textContent = `Replay selected (${n})`;
  btn.disabled = n === 0;
  $("#dead-replay-all").disabled = dead.shown.length === 0;
}

// Schedules (issue 18): list with next and last ticks, run now, pause and resume.

async function scheduleAction(s, action) {
  const what = {
    fire: [`Run schedule ${s.name} now? One task is submitted at once, besides its ticks.`, "fire"],
    pause: [`Pause schedule ${s.name}? Its ticks are not fired until it is resumed.`, "pause"],
    resume: [`Resume schedule ${s.name}? It fires from its next tick (missed ticks follow its policy).`, "resume"],
  }[action];
  if (!(await confirmAction(what[0]))) return;
  const r = await actionApi(`${action} ${s.name}`, `/v1/schedules/${encodeURIComponent(s.name)}/${what[1]}`, { method: "POST", body: {} });
  if (!r) return;
  if (action === "fire" && r.status === 202) notice(`Schedule ${s.name} fired: task ${r.body.id}.`);
  else if (r.status === 200) notice(`Schedule ${s.name} ${action === "pause" ? "paused" : "resumed"}.`);
  else notice(`Cannot ${action === "fire" ? "run" : action} ${s.name}: ${problem(r)}`, false);
  refreshNow();
}

function lastRun(s) {
  if (!s.last_outcome) return h("span", { class: "muted" }, "–");
  if (s.last_outcome !== "fired") return h("span", { class: "badge dead" }, s.last_outcome);
  const t = s.last_task || {};
  return h("span", {}, h("span", { class: "badge ok" }, "fired"), " ",
    h("a", { href: "#task", class: "mono task-link", dataset: { task: t.id || "" }, on: { click: (e) => { e.preventDefault(); openTask(t.id); } } }, t.id || "?"),
    " ", h("span", { class: `badge ${t.state || ""}`, dataset: { k: "last-state" } }, t.state || "no status"));
}

async function renderSchedules() {
  const r = await api("/v1/schedules");
  if (r.status === 503 && r.body && r.body.error === "schedules_loading") {
    $("#schedules-table tbody").replaceChildren(h("tr", { class: "empty" }, h("td", { colspan: 10 }, "This scheduler has not read the schedule definitions yet.")));
    return;
  }
  if (r.status !== 200) throw new Error(problem(r));
  const list = [...r.body].sort((a, b) => a.name.localeCompare(b.name));
  const rows = list.map((s) => {
    const task = s.task || {};
    const missed = s.missed === "catch_up" ? `catch up (max ${s.catch_up_max})` : s.missed;
    return h("tr", { dataset: { schedule: s.name } },
      h("td", { class: "mono" }, s.name),
      h("td", { dataset: { k: "state" } }, h("span", { class: `badge ${s.enabled ? "active" : "paused"}` }, s.enabled ? "active" : "paused")),
      h("td", {},
        h("button", { class: "small run-now", on: { click: () => scheduleAction(s, "fire") } }, "Run now"), " ",
        s.enabled
          ? h("button", { class: "small pause", on: { click: () => scheduleAction(s, "pause") } }, "Pause")
          : h("button", { class: "small resume", on: { click: () => scheduleAction(s, "resume") } }, "Resume")),
      h("td", { dataset: { k: "next" } }, timeEl(s.next_tick)),
      h("td", { dataset: { k: "last" } }, timeEl(s.last_tick)),
      h("td", { class: "wrap", dataset: { k: "last-run" } }, lastRun(s)),
      h("td", { class: "mono", dataset: { k: "cron" } }, s.cron),
      h("td", { dataset: { k: "timezone" } }, s.timezone),
      h("td", { class: "wrap", dataset: { k: "task" } }, `${task.kind ?? "–"}${task.labels ? ` (${fmt.labels(task.labels)})` : ""}`),
      h("td", { dataset: { k: "missed" } }, missed ?? "–"));
  });
  $("#schedules-table tbody").replaceChildren(...(rows.length ? rows : [h("tr", { class: "empty" }, h("td", { colspan: 10 }, "No schedules."))]));
}

function openTask(id) {
  if (!id) return;
  $("#task-id").value = id;
  if (location.hash !== "#task") location.hash = "#task";
  else refreshNow();
}

async function cancelTask(id) {
  if (!(await confirmAction(`Cancel task ${id}? Not yet running, it never runs; running, its run is stopped. It is never retried.`))) return;
  const r = await actionApi(`Cancel ${id}`, `/v1/tasks/${encodeURIComponent(id)}/cancel`, { method: "POST", body: { reason: "cancelled from the console" } });
  if (!r) return;
  if (r.status === 202) notice(`Task ${id} cancelled (was ${r.body.previous_state}).`);
  else if (r.status === 200) notice(`Task ${id} was already cancelled.`);
  else if (r.status === 409) notice(`Task ${id} has ended (${r.body.state}): nothing to cancel.`, false);
  else notice(`Cannot cancel ${id}: ${problem(r)}`, false);
  refreshNow();
}

/** Cancels batch `id` as a whole after the operator confirms (POST /v1/batches/{id}/cancel). */
async function cancelBatch(id) {
  if (!(await confirmAction(`Cancel batch ${id}? Its callbacks never fire; members not yet running never run, running ones are stopped, waiting ones are never released.`))) return;
  const r = await actionApi(`Cancel batch ${id}`, `/v1/batches/${encodeURIComponent(id)}/cancel`, { method: "POST", body: { reason: "cancelled from the console" } });
  if (!r) return;
  if (r.status === 202) notice(`Batch ${id} ${r.body.already ? "was already cancelled" : "cancelled"}: ${r.body.cancelled} member(s) cancelled, ${r.body.already_ended} had ended.`);
  else if (r.status === 409) notice(`Every member of batch ${id} has ended: nothing to cancel.`, false);
  else notice(`Cannot cancel batch ${id}: ${problem(r)}`, false);
  refreshNow();
}

function row(k, v) { return [h("dt", {}, k), h("dd", { dataset: { k } }, v)]; }

async function lookupTask(id) {
  const out = $("#task-result");
  const r = await api(`/v1/tasks/${encodeURIComponent(id)}`);
  if (r.status === 404) { out.replaceChildren(h("p", { class: "muted", id: "task-missing" }, `No status for task ${id}: never seen, or older than the status TTL.`)); return; }
  if (r.status !== 200) { out.replaceChildren(h("p", { class: "error" }, problem(r))); return; }
  const t = r.body;
  const time = /(_at|_ms)$/;
  const known = ["id", "kind", "submitted_at", "state", "attempt", "max_attempts", "group", "lane", "worker", "reason", "error", "result", "attempts"];
  const dl = h("dl", { class: "kv", id: "task-fields" },
    row("id", t.id),
    row("kind", t.kind ?? "–"),
    row("submitted_at", t.submitted_at ? timeEl(t.submitted_at) : "–"),
    row("state", h("span", { class: `badge ${t.state}` }, t.state ?? "–")),
    ...["attempt", "max_attempts", "group", "lane", "worker", "reason", "error", "result"].filter((k) => t[k] !== undefined).flatMap((k) => row(k, String(t[k]))),
    ...Object.keys(t).filter((k) => !known.includes(k)).sort().flatMap((k) => row(k, time.test(k) || k === "not_before" ? timeEl(t[k]) : String(t[k]))));
  // A task that has not ended may be cancelled (admin): it never runs, or its run is stopped.
  const ended = ["succeeded", "dead", "expired", "cancelled"].includes(t.state);
  const cancelBtn = ended ? null : h("p", {}, h("button", { class: "small cancel", id: "task-cancel", on: { click: () => cancelTask(t.id) } }, "Cancel task"));
  const parts = [h("div", { class: "card" }, h("h2", {}, "Status"), dl, cancelBtn)];
  const attempts = Array.isArray(t.attempts) ? t.attempts : [];
  const rows = attempts.map((a) => h("tr", { dataset: { attempt: String(a.attempt) } },
    h("td", { class: "num", dataset: { k: "attempt" } }, String(a.attempt)),
    h("td", { class: "mono", dataset: { k: "worker" } }, a.worker ?? "–"),
    h("td", { dataset: { k: "started" } }, timeEl(a.started_at)),
    h("td", { dataset: { k: "finished" } }, timeEl(a.finished_at)),
    h("td", { dataset: { k: "outcome" } }, h("span", { class: `badge ${a.outcome}` }, a.outcome)),
    h("td", { dataset: { k: "reason" } }, a.outcome === "cancelled" ? `by ${a.cancelled_by ?? "?"}${a.cancel_reason ? `: ${a.cancel_reason}` : ""}` : (a.reason ?? "")),
    h("td", { class: "detail", dataset: { k: "error" } }, a.error ?? "")));
  const running = t.state === "running" ? h("p", { class: "help" }, `Attempt ${t.attempt} is running on ${t.worker}; it joins the log when it ends.`) : null;
  parts.push(h("div", { class: "card attempts" }, h("h2", {}, "Attempts ", h("small", {}, "oldest first; the latest 20 are kept as long as the status")),
    h("div", { class: "scroll" }, h("table", { id: "task-attempts" },
      h("thead", {}, h("tr", {}, ["Attempt", "Worker", "Started", "Finished", "Outcome", "Reason", "Error"].map((c) => h("th", {}, c)))),
      h("tbody", {}, rows.length ? rows : h("tr", { class: "empty" }, h("td", { colspan: 7 }, "No attempt has ended yet."))))), running));
  out.replaceChildren(...parts);
}

/** A batch's progress (GET /v1/batches/{id}): a bar of ended / total, the counts per final
 * state, the members that did not succeed (each opens its task), the callbacks and which fired. */
async function lookupBatch(id) {
  const out = $("#batch-result");
  const r = await api(`/v1/batches/${encodeURIComponent(id)}`);
  if (r.status === 404) { out.replaceChildren(h("p", { class: "muted", id: "batch-missing" }, `No batch ${id}: never submitted, or older than the control stream's retention.`)); return; }
  if (r.status !== 200) { out.replaceChildren(h("p", { class: "error" }, problem(r))); return; }
  const b = r.body;
  const ended = b.total - b.pending;
  const pct = b.total ? Math.floor((100 * ended) / b.total) : 100;
  const bar = h("div", { class: "progress", id: "batch-bar", role: "progressbar", "aria-valuemin": "0", "aria-valuemax": String(b.total), "aria-valuenow": String(ended) },
    h("div", { class: "progress-fill", vars: { "--pct": `${pct}%` } }));
  const dl = h("dl", { class: "kv", id: "batch-fields" },
    row("id", b.id),
    row("state", h("span", { class: `badge ${b.cancel ? "cancelled" : b.complete ? "succeeded" : "running"}` }, b.cancel ? "cancelled" : b.complete ? "complete" : "running")),
    ...(b.cancel ? row("cancel", `${new Date(b.cancel.at_ms).toISOString()} by ${b.cancel.by}${b.cancel.reason ? `: ${b.cancel.reason}` : ""}`) : []),
    row("accepted", timeEl(new Date(b.at_ms).toISOString())),
    row("total", String(b.total)),
    row("ended", `${ended} (${pct} %)`),
    ...["succeeded", "dead", "expired", "cancelled", "pending"].flatMap((k) => row(k, String(b[k]))),
    row("callbacks", b.callbacks.length ? b.callbacks.map((c) => `${c}${b.fired.includes(c) ? " (fired)" : ""}`).join(", ") : "none"));
  const failed = b.failed.map((t) => h("li", {}, h("a", { href: "#task", dataset: { id: t }, on: { click: (e) => { e.preventDefault(); openTask(t); } } }, t)));
  // A batch not cancelled with members not yet ended may be cancelled as a whole, or paused
  // and resumed (admin).
  const pr = await api("/v1/pauses");
  const pause = pr.status === 200 ? (pr.body.pauses || []).find((p) => p.scope === "batch" && p.batch === b.id) : null;
  const target = { scope: "batch", batch: b.id };
  const open = !(b.cancel || b.complete);
  const cancelBtn = !open && !pause ? null : h("p", {},
    open ? h("button", { class: "small cancel", id: "batch-cancel", on: { click: () => cancelBatch(b.id) } }, "Cancel batch") : null, " ",
    pause
      ? h("span", {}, h("span", { class: "badge paused", id: "batch-paused" }, `paused · ${pause.held ?? 0} held`), " ",
        h("button", { class: "small resume", id: "batch-resume", on: { click: () => setPause(target, false, `batch ${b.id}`) } }, "Resume"))
      : (open ? h("button", { class: "small pause", id: "batch-pause", on: { click: () => setPause(target, true, `batch ${b.id}`) } }, "Pause") : null));
  out.replaceChildren(h("div", { class: "card" }, h("h2", {}, "Progress"), bar, dl, cancelBtn),
    h("div", { class: "card" }, h("h2", {}, "Did not succeed ", h("small", {}, "in submission order")),
      failed.length ? h("ul", { id: "batch-failed" }, ...failed) : h("p", { class: "muted", id: "batch-failed" }, "None.")));
}

// ---------------------------------------------------------------- shell

const RENDER = { overview: renderOverview, groups: renderGroups, workers: renderWorkers, dead: renderDead, schedules: renderSchedules, tasks: renderTasks, keys: (...a) => renderKeys(...a), audit: (...a) => renderAudit(...a), task: async () => {
  const id = $("#task-id").value.trim();
  // With nothing to look up yet, one cheap read still checks the token (a console opened on
  // this view with none or a stale one shows the prompt, not an empty page).
  if (id) await lookupTask(id); else await api("/v1/pressure");
}, batch: async () => {
  const id = $("#batch-id").value.trim();
  if (id) await lookupBatch(id); else await api("/v1/pressure");
} };

let lastOk = 0;
let timer = null;
let signedIn = false;
// Each refresh takes a number; an answer that comes back after a newer refresh started (or
// after signing out) is dropped, so a slow answer never overwrites a newer page.
let generation = 0;

function currentView() {
  const v = location.hash.replace("#", "");
  return VIEWS.includes(v) ? v : "overview";
}

function showView() {
  const v = currentView();
  for (const name of VIEWS) $(`#view-${name}`).hidden = name !== v;
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.dataset.view === v);
}

function showLogin(message) {
  signedIn = false;
  $("#notice").hidden = true;
  $("#main").hidden = true;
  $("#nav").hidden = true;
  $("#live").hidden = true;
  $("#signout").hidden = true;
  $("#unreachable").hidden = true;
  // Nothing of the fleet stays on the page.
  for (const tb of document.querySelectorAll("tbody")) tb.replaceChildren();
  for (const c of document.querySelectorAll(".chart, #task-result")) c.replaceChildren();
  $("#login").hidden = false;
  const err = $("#login-error");
  err.textContent = message || "";
  err.hidden = !message;
  $("#token").focus();
}

function showMain() {
  signedIn = true;
  $("#login").hidden = true;
  $("#main").hidden = false;
  $("#nav").hidden = false;
  $("#live").hidden = false;
  $("#signout").hidden = !token.get();
  showView();
}

async function refresh() {
  clearTimeout(timer);
  const gen = ++generation;
  const view = currentView();
  try {
    await RENDER[view]();
    if (gen !== generation) return;
    if (!signedIn) showMain();
    lastOk = Date.now();
    $("#unreachable").hidden = true;
    $("#main").classList.remove("stale");
    $("#live").classList.remove("stale");
    $("#live").textContent = `live · updated ${new Date(lastOk).toLocaleTimeString()}`;
  } catch (e) {
    if (gen !== generation) return;
    if (e instanceof Unauthorized) {
      const had = token.get();
      token.clear();
      showLogin(had ? "That token was refused (401). Enter a valid token." : "");
      return;
    }
    if (e instanceof Stale) {
      const u = $("#unreachable");
      u.textContent = `Stale: ${e.message}. Retrying every ${REFRESH_MS / 1000} s…`;
      u.hidden = false;
      $("#main").classList.add("stale");
      $("#live").classList.add("stale");
      $("#live").textContent = "stale";
    } else if (e instanceof Unreachable) {
      const since = lastOk ? `; last update ${new Date(lastOk).toLocaleTimeString()}` : "";
      const u = $("#unreachable");
      const why = e.message.startsWith("HTTP") ? ` (${e.message})` : "";
      u.textContent = `The scheduler is unreachable${why}${since}. Retrying every ${REFRESH_MS / 1000} s…`;
      u.hidden = false;
      $("#main").classList.add("stale");
      $("#live").classList.add("stale");
      $("#live").textContent = "unreachable";
    } else {
      notice(`Cannot load ${view}: ${e.message}`, false);
    }
  }
  timer = setTimeout(refresh, REFRESH_MS);
}

function refreshNow() { refresh(); }

function boot() {
  window.addEventListener("hashchange", () => { showView(); refreshNow(); });
  $("#login-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const t = $("#token").value.trim();
    if (!t) return;
    token.set(t, $("#remember").checked);
    $("#token").value = "";
    refreshNow();
  });
  $("#signout").addEventListener("click", () => { token.clear(); clearTimeout(timer); generation++; showLogin(""); });
  $("#task-form").addEventListener("submit", (e) => {
    e.preventDefault();
    if (location.hash !== "#task") location.hash = "#task";
    refreshNow();
  });
  $("#batch-form").addEventListener("submit", (e) => {
    e.preventDefault();
    if (location.hash !== "#batch") location.hash = "#batch";
    refreshNow();
  });
  $("#dead-reason").addEventListener("change", refreshNow);
  $("#dead-kind").addEventListener("change", refreshNow);
  $("#dead-all").addEventListener("change", (e) => {
    for (const d of dead.shown) if (d.replayable) { if (e.target.checked) dead.selected.add(d.id); else dead.selected.delete(d.id); }
    for (const c of document.querySelectorAll("#dead-table .pick")) if (!c.disabled) c.checked = e.target.checked;
    updateDeadButtons();
  });
  $("#dead-replay-selected").addEventListener("click", () => replay({ ids: [...dead.selected] }, `${dead.selected.size} selected dead letter(s)`));
  $("#dead-replay-all").addEventListener("click", () => {
    const reason = $("#dead-reason").value, kind = $("#dead-kind").value;
    const filter = [reason && `reason ${reason}`, kind && `kind ${kind}`].filter(Boolean).join(", ");
    replay({ all: true, reason: reason || undefined, kind: kind || undefined }, filter ? `every dead letter with ${filter}` : "every dead letter");
  });
  showView();
  refresh();
}

boot();

// ==== pause and resume (issue 32 item 2) ====
// A group row's pause cell (a paused badge and Resume, or Pause), and the kinds panel under the
// groups table (#kind-pauses: paused kinds with their held tasks and Resume, a form to pause a
// kind). Pauses are durable operator actions: POST /v1/pauses and /v1/pauses/resume (admin).

/** The pause cell of a group row of GET /v1/groups. */
function pauseCell(g) {
  const lanes = g.paused_lanes || [];
  const target = { scope: "group", group: g.group };
  if (!lanes.length) return h("button", { class: "pause", on: { click: () => setPause(target, true, `group ${g.group}`) } }, "Pause");
  const which = lanes.length === 2 ? "paused" : `paused: ${lanes[0]}`;
  return h("span", {},
    h("span", { class: "badge paused", title: `${g.backlog_paused ?? 0} task(s) wait, not counted as ready backlog` }, `${which} · ${g.backlog_paused ?? 0} waiting`), " ",
    h("button", { class: "resume", on: { click: () => setPause(target, false, `group ${g.group}`) } }, "Resume"));
}

/** Pauses (or resumes) `target` after the operator confirms. */
async function setPause(target, pausing, what) {
  const text = pausing
    ? `Pause ${what}? It takes no new work until resumed (durable: it holds across restarts). Tasks already in its queue still run; the rest wait in the broker.`
    : `Resume ${what}? Its waiting tasks are dispatched again.`;
  if (!(await confirmAction(text))) return;
  const r = await actionApi(`${pausing ? "Pause" : "Resume"} ${what}`, pausing ? "/v1/pauses" : "/v1/pauses/resume", { method: "POST", body: target });
  if (!r) return;
  if (r.status === 202) notice(`${what}: ${pausing ? "paused" : "resumed"}.`);
  else if (r.status === 200) notice(`${what}: ${pausing ? "already paused" : "not paused"}.`);
  else notice(`Cannot ${pausing ? "pause" : "resume"} ${what}: ${problem(r)}`, false);
  refreshNow();
}

/** The kinds panel: paused kinds (GET /v1/pauses) and the form that pauses one. */
async function renderKindPauses() {
  const box = $("#kind-pauses");
  if (!box) return;
  const r = await api("/v1/pauses");
  if (r.status !== 200) throw new Error(problem(r));
  const kinds = (r.body.pauses || []).filter((p) => p.scope === "kind");
  const rows = kinds.map((p) => h("tr", { dataset: { kind: p.kind } },
    h("td", { class: "mono" }, p.kind),
    h("td", {}, h("span", { class: "badge paused" }, "paused")),
    h("td", { class: "num", dataset: { k: "held" } }, String(p.held ?? 0)),
    h("td", {}, timeEl(p.since)),
    h("td", {}, p.by || "–"),
    h("td", {}, p.reason || "–"),
    h("td", {}, h("button", { class: "resume", on: { click: () => setPause({ scope: "kind", kind: p.kind }, false, `kind ${p.kind}`) } }, "Resume"))));
  box.replaceChildren(
    h("h3", {}, "Paused kinds"),
    h("p", { class: "help" }, "A paused kind is dispatched to no group; its tasks wait in its hold queue (not behind a group, so other kinds run)."),
    h("table", { id: "kind-pauses-table" },
      h("thead", {}, h("tr", {}, ["Kind", "State", "Held", "Since", "By", "Reason", ""].map((t) => h("th", {}, t)))),
      h("tbody", {}, rows.length ? rows : h("tr", { class: "empty" }, h("td", { colspan: 7 }, "No kind is paused.")))),
    h("form", { id: "kind-pause-form", on: { submit: (e) => {
      e.preventDefault();
      const kind = $("#kind-pause-name").value.trim();
      if (kind) setPause({ scope: "kind", kind, reason: $("#kind-pause-reason").value.trim() || undefined }, true, `kind ${kind}`);
    } } },
      h("input", { id: "kind-pause-name", placeholder: "kind", "aria-label": "kind to pause" }), " ",
      h("input", { id: "kind-pause-reason", placeholder: "reason (optional)", "aria-label": "reason" }), " ",
      h("button", { type: "submit" }, "Pause kind")));
}

// The groups view renders the kinds panel too (without losing what the operator is typing).
{
  const groupsView = RENDER.groups;
  RENDER.groups = async () => {
    await groupsView();
    const a = document.activeElement;
    const typing = a && a.tagName === "INPUT" && a.closest("#kind-pause-form") && a.value !== "";
    if (!typing) await renderKindPauses();
  };
  if (currentView() === "groups") refreshNow();
}
// ==== tasks: browse tasks by state, bulk actions by query with a dry run (issue 32) ====
// GET /v1/tasks (filters, per-state counts, pages newest first) and POST /v1/tasks/bulk
// (cancel / retry / delete of a selection or of everything matching, each confirmed with the
// dry run's count and sample). State lives on a hoisted function (boot() runs before this
// block is evaluated, and may call renderTasks).

/** The states, in the order shown (a function: see the note above on boot order). */
function taskStates() { return ["queued", "parked", "delayed", "waiting_for_worker", "waiting", "retrying", "running", "succeeded", "dead", "expired", "cancelled"]; }

/** The view's state: filters as applied, the cursor stack (pages), the selection. */
function tasksState() {
  if (!tasksState.s) tasksState.s = { cursors: [null], page: 0, selected: new Set(), all: false, total: 0, shown: [], wired: false };
  return tasksState.s;
}

/** A link to the Tasks view with `filter` ({state, group, kind, label}) applied. */
function tasksLink(text, filter) {
  return h("a", { href: "#tasks", class: "tasks-link", on: { click: (e) => { e.preventDefault(); tasksOpen(filter); } } }, text);
}

function tasksOpen(filter) {
  for (const k of ["state", "group", "kind", "label", "since", "until"]) {
    const el = $(`#tasks-${k}`);
    if (el) el.value = filter[k] || "";
  }
  tasksReset();
  if (location.hash !== "#tasks") location.hash = "#tasks"; else refreshNow();
}

/** The filters from the form, as query pairs (blank ones left out). */
function tasksFilter() {
  const f = {};
  for (const k of ["state", "group", "kind", "label", "since", "until"]) {
    const v = ($(`#tasks-${k}`)?.value || "").trim();
    if (v) f[k] = v;
  }
  return f;
}

function tasksReset() {
  const s = tasksState();
  s.cursors = [null]; s.page = 0; s.selected.clear(); s.all = false;
}

async function renderTasks() {
  const s = tasksState();
  tasksWire();
  const f = tasksFilter();
  const q = new URLSearchParams({ ...f, limit: "50" });
  const cur = s.cursors[s.page];
  if (cur) q.set("cursor", cur);
  const r = await api(`/v1/tasks?${q}`);
  if (r.status === 400) { notice(`Tasks: ${problem(r)}`, false); return; }
  if (r.status !== 200) throw new Error(problem(r));
  const b = r.body;
  s.total = b.total; s.shown = b.tasks;
  s.cursors[s.page + 1] = b.next || undefined;
  // Per-state counts: each a button that filters by its state.
  const chips = taskStates().map((st) => h("button", {
    class: `chip${f.state === st ? " active" : ""}`, dataset: { state: st, count: String(b.counts[st] ?? 0) },
    on: { click: () => { $("#tasks-state").value = f.state === st ? "" : st; tasksReset(); refreshNow(); } },
  }, `${st.replaceAll("_", " ")} `, h("b", {}, fmt.n(b.counts[st] ?? 0))));
  $("#tasks-counts").replaceChildren(h("span", { class: "muted" }, `${fmt.n(b.total)} matching${b.complete ? "" : " (counted over the first 200,000 only)"}`), ...chips);
  const rows = b.tasks.map((t) => h("tr", { dataset: { task: t.id, state: t.state } },
    h("td", {}, h("input", { type: "checkbox", class: "pick", checked: s.all || s.selected.has(t.id), disabled: s.all, "aria-label": `select ${t.id}`,
      on: { change: (e) => { if (e.target.checked) s.selected.add(t.id); else s.selected.delete(t.id); tasksButtons(); } } })),
    h("td", { class: "mono" }, h("a", { href: "#task", on: { click: (e) => { e.preventDefault(); $("#task-id").value = t.id; location.hash = "#task"; } } }, t.id)),
    h("td", { dataset: { k: "state" } }, h("span", { class: `badge ${t.state}` }, t.state)),
    h("td", { dataset: { k: "kind" } }, t.kind ? tasksLink(t.kind, { ...f, kind: t.kind }) : "–"),
    h("td", { class: "mono", dataset: { k: "group" } }, t.group ? tasksLink(t.group, { ...f, group: t.group }) : "–"),
    h("td", { class: "mono" }, t.selector || "–"),
    h("td", {}, t.lane || "–"),
    h("td", {}, timeEl(t.submitted_at))));
  $("#tasks-table tbody").replaceChildren(...(rows.length ? rows : [h("tr", { class: "empty" }, h("td", { colspan: 8 }, "No task matches."))]));
  $("#tasks-page-info").textContent = `page ${s.page + 1}`;
  $("#tasks-newer").disabled = s.page === 0;
  $("#tasks-older").disabled = !b.next;
  $("#tasks-all").checked = s.all || (b.tasks.length > 0 && b.tasks.every((t) => s.selected.has(t.id)));
  tasksButtons();
}

function tasksButtons() {
  const s = tasksState();
  const n = s.all ? s.total : s.selected.size;
  $("#tasks-selection").textContent = s.all ? `all ${fmt.n(s.total)} matching selected` : `${fmt.n(n)} selected`;
  $("#tasks-select-matching").textContent = s.all ? "Clear selection" : `Select all ${fmt.n(s.total)} matching`;
  for (const b of ["cancel", "retry", "delete"]) $(`#tasks-${b}`).disabled = n === 0;
}

/** Dry run, confirm with its count and sample, then run; the notice says what happened. */
async function tasksBulk(action) {
  const s = tasksState();
  const body = { action };
  if (s.all) {
    const f = tasksFilter();
    body.query = { ...f, state: f.state ? [f.state] : undefined };
  } else body.ids = [...s.selected];
  const dry = await actionApi(`${action} (dry run)`, "/v1/tasks/bulk", { method: "POST", body: { ...body, dry_run: true } });
  if (!dry) return;
  if (dry.status !== 200) { notice(`Cannot ${action}: ${problem(dry)}`, false); return; }
  const d = dry.body;
  if (d.count === 0) { notice(`Nothing to ${action}: none of the selected tasks is in a state ${action} takes.`, false); return; }
  const what = { cancel: "Cancel", retry: "Retry (replay as a new run)", delete: "Delete the dead letters of" }[action];
  const skipped = Object.entries(d.ineligible || {}).map(([st, n]) => `${n} ${st}`).join(", ");
  const text = `${what} ${d.count} task(s)?${skipped ? ` Not taken (their state): ${skipped}.` : ""} Sample: ${d.sample.join(", ")}${d.count > d.sample.length ? ", …" : ""}`;
  if (!(await confirmAction(text))) return;
  const r = await actionApi(action, "/v1/tasks/bulk", { method: "POST", body });
  if (!r) return;
  if (r.status !== 200) { notice(`${action} failed: ${problem(r)}`, false); return; }
  const o = r.body;
  notice(`${action}: ${o.applied} applied, ${o.skipped} skipped, ${o.failed} failed (of ${o.count}).`, o.failed === 0);
  tasksReset();
  refreshNow();
}

/** Wires the view's controls once. */
function tasksWire() {
  const s = tasksState();
  if (s.wired) return;
  s.wired = true;
  const sel = $("#tasks-state");
  if (sel.options.length <= 1) for (const st of taskStates()) sel.append(h("option", { value: st }, st));
  $("#tasks-form").addEventListener("submit", (e) => { e.preventDefault(); tasksReset(); refreshNow(); });
  sel.addEventListener("change", () => { tasksReset(); refreshNow(); });
  $("#tasks-clear").addEventListener("click", () => tasksOpen({}));
  $("#tasks-newer").addEventListener("click", () => { if (s.page > 0) { s.page--; refreshNow(); } });
  $("#tasks-older").addEventListener("click", () => { if (s.cursors[s.page + 1]) { s.page++; refreshNow(); } });
  $("#tasks-all").addEventListener("change", (e) => {
    s.all = false;
    for (const t of s.shown) { if (e.target.checked) s.selected.add(t.id); else s.selected.delete(t.id); }
    for (const c of document.querySelectorAll("#tasks-table .pick")) { c.checked = e.target.checked; c.disabled = false; }
    tasksButtons();
  });
  $("#tasks-select-matching").addEventListener("click", () => {
    s.all = !s.all; s.selected.clear();
    for (const c of document.querySelectorAll("#tasks-table .pick")) { c.checked = s.all; c.disabled = s.all; }
    $("#tasks-all").checked = s.all;
    tasksButtons();
  });
  for (const a of ["cancel", "retry", "delete"]) $(`#tasks-${a}`).addEventListener("click", () => tasksBulk(a));
}

// ==== audit log ====
// GET /v1/audit: the operator actions newest first, filtered by action and token name; the
// figures are the API's (total = entries matching, as of the answer's time).
function auditTarget(t) {
  if (t === null || t === undefined) return "–";
  if (typeof t !== "object") return String(t);
  return Object.entries(t)
    .filter(([, v]) => v !== null && v !== undefined && !(Array.isArray(v) && v.length === 0))
    .map(([k, v]) => `${k}=${Array.isArray(v) ? v.join(",") : typeof v === "object" ? JSON.stringify(v) : v}`)
    .join(" ") || "–";
}

async function renderAudit() {
  const q = new URLSearchParams({ limit: "200" });
  const action = $("#audit-action").value.trim();
  const by = $("#audit-by").value.trim();
  if (action) q.set("action", action);
  if (by) q.set("by", by);
  const r = await api(`/v1/audit?${q}`);
  if (r.status === 503 && r.body && r.body.error === "audit_loading") {
    $("#audit-count").textContent = "";
    $("#audit-table tbody").replaceChildren(h("tr", { class: "empty" }, h("td", { colspan: 7 }, "This scheduler has not read the control stream yet.")));
    return;
  }
  if (r.status !== 200) throw new Error(problem(r));
  const days = Math.round((r.body.retention_seconds || 0) / 86400);
  if (days) $("#audit-retention").textContent = `${days} days`;
  $("#audit-count").textContent = `${r.body.entries.length} of ${r.body.total} shown, as of ${r.body.as_of}`;
  const rows = r.body.entries.map((e) => h("tr", { dataset: { id: e.id, action: e.action } },
    h("td", { dataset: { k: "at" } }, timeEl(e.at)),
    h("td", { dataset: { k: "action" } }, e.action),
    h("td", { class: "mono", dataset: { k: "by" } }, e.by),
    h("td", { dataset: { k: "role" } }, e.role || "–"),
    h("td", { class: "num", dataset: { k: "count" } }, String(e.count)),
    h("td", { class: "wrap mono", dataset: { k: "target" } }, auditTarget(e.target)),
    h("td", { class: "wrap", dataset: { k: "reason" } }, e.reason || "")));
  $("#audit-table tbody").replaceChildren(...(rows.length ? rows : [h("tr", { class: "empty" }, h("td", { colspan: 7 }, "No action recorded."))]));
}

$("#audit-form").addEventListener("submit", (ev) => { ev.preventDefault(); refreshNow(); });

// ==== fairness keys (issue 33) ====
// GET /v1/keys: per key its figures and the limits in force, most waiting first; the form sets
// a key's spec (or the default's, key `*`) with PUT /v1/keys/{key}/limits (admin), `{}` clears.

const SPEC_FIELDS = [["max_running", "#keys-max", "int"], ["min_running", "#keys-min", "int"], ["rate", "#keys-rate", "num"], ["burst", "#keys-burst", "int"], ["weight", "#keys-weight", "num"]];

function specText(s) {
  const parts = SPEC_FIELDS.map(([f]) => f).filter((f) => s && s[f] !== undefined && s[f] !== null).map((f) => `${f}=${s[f]}`);
  return parts.length ? parts.join(", ") : "nothing set";
}

async function renderKeys() {
  const r = await api("/v1/keys");
  if (r.status !== 200) throw new Error(problem(r));
  const d = r.body.default || {};
  $("#keys-default").textContent = `Default spec (${d.source || "settings"}): ${specText(d)}`;
  $("#keys-asof").textContent = `${r.body.keys.length} key(s), as of ${fmt.iso(r.body.as_of)}`;
  const num = (v) => (v === null || v === undefined ? "–" : String(v));
  const rows = r.body.keys.map((k) => h("tr", { dataset: { key: k.key } },
    h("td", { class: "mono", dataset: { k: "key" } }, k.key),
    h("td", { class: "num", dataset: { k: "running" } }, num(k.running)),
    h("td", { class: "num", dataset: { k: "reserved" } }, num(k.reserved)),
    h("td", { class: "num", dataset: { k: "waiting" } }, num(k.waiting)),
    h("td", { class: "num", dataset: { k: "dispatched" } }, num(k.dispatched)),
    h("td", { class: "num", dataset: { k: "max_running" } }, num(k.max_running)),
    h("td", { class: "num", dataset: { k: "min_running" } }, num(k.min_running)),
    h("td", { class: "num", dataset: { k: "rate" } }, num(k.rate)),
    h("td", { class: "num", dataset: { k: "burst" } }, num(k.burst)),
    h("td", { class: "num", dataset: { k: "weight" } }, num(k.weight)),
    h("td", { dataset: { k: "source" }, title: k.set_by ? `set by ${k.set_by} at ${fmt.iso(k.set_at)}${k.reason ? ` — ${k.reason}` : ""}` : undefined }, k.source),
    h("td", { dataset: { k: "paused" } }, k.paused ? h("span", { class: "badge paused" }, "paused") : "–"),
    h("td", {},
      h("button", { class: "edit", on: { click: () => keysEdit(k) } }, "Edit"), " ",
      k.paused
        ? h("button", { class: "resume", on: { click: () => setPause({ scope: "key", key: k.key }, false, `key ${k.key}`) } }, "Resume")
        : h("button", { class: "pause", on: { click: () => setPause({ scope: "key", key: k.key }, true, `key ${k.key}`) } }, "Pause"))));
  $("#keys-table tbody").replaceChildren(...(rows.length ? rows : [h("tr", { class: "empty" }, h("td", { colspan: 13 }, "No key is known yet: none has limits or recent tasks."))]));
}

/** Fills the form with a row's key (its own limits are typed anew: the row shows them merged). */
function keysEdit(k) {
  $("#keys-key").value = k.key;
  for (const [f, sel] of SPEC_FIELDS) $(sel).value = k.source === "default" || k[f] === null || k[f] === undefined ? "" : String(k[f]);
  $("#keys-key").focus();
}

/** The spec the form holds; throws naming a bad field. */
function keysSpec() {
  const spec = {};
  for (const [f, sel, kind] of SPEC_FIELDS) {
    const v = $(sel).value.trim();
    if (v === "") continue;
    const n = Number(v);
    if (!Number.isFinite(n) || (kind === "int" && !Number.isInteger(n))) throw new Error(`${f} must be ${kind === "int" ? "a whole number" : "a number"}`);
    spec[f] = n;
  }
  return spec;
}

async function keysSubmit(clear) {
  const key = $("#keys-key").value.trim();
  if (!key) return;
  let spec;
  try { spec = clear ? {} : keysSpec(); } catch (e) { notice(e.message, false); return; }
  if (!clear && !Object.keys(spec).length) { notice("Give at least one limit, or Clear.", false); return; }
  const reason = $("#keys-reason").value.trim();
  const what = key === "*" ? "the default spec" : `key ${key}`;
  const r = await actionApi(`Set limits of ${what}`, `/v1/keys/${encodeURIComponent(key)}/limits`, { method: "PUT", body: reason ? { ...spec, reason } : spec });
  if (!r) return;
  if (r.status === 202) notice(`${what}: ${clear ? "cleared" : `set (${specText(spec)})`}.`);
  else if (r.status === 200) notice(`${what}: already ${clear ? "cleared" : "set so"}.`);
  else notice(`Cannot set the limits of ${what}: ${problem(r)}`, false);
  refreshNow();
}

$("#keys-form").addEventListener("submit", (ev) => { ev.preventDefault(); keysSubmit(false); });
$("#keys-clear").addEventListener("click", () => keysSubmit(true));
