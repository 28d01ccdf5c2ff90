// Browser half of tests/tests/e2e/console.rs: drives fleet's console (/ui) in Debian's chromium with
// playwright-core and checks it against the API. Environment (set by the Rust test):
//   FLEET_UI_BASE       scheduler base URL, e.g. http://127.0.0.1:PORT
//   FLEET_ADMIN_TOKEN   token with role admin; FLEET_READ_TOKEN: role read
//   FLEET_EXPECT        JSON: busy_group, idle_group, drain_worker, replay_one, replay_selected,
//                       stays_dead, succeeded_task, workers, schedules {active, paused,
//                       paused_task}
//   FLEET_SCREENSHOTS   directory for the screenshots
//   CHROMIUM            browser binary (default /usr/bin/chromium)
// Prints "@stop-scheduler" and waits for "stopped URL" on stdin (URL: a scheduler without
// tokens) before checking the banner shown when the scheduler is unreachable, then the page of
// the open scheduler. Exits non-zero on the first failed check.

import { join } from "node:path";
import { createInterface } from "node:readline";
import { eq, fail, launch, until } from "./lib.mjs";

const BASE = process.env.FLEET_UI_BASE;
const ADMIN = process.env.FLEET_ADMIN_TOKEN;
const READ = process.env.FLEET_READ_TOKEN;
const EXPECT = JSON.parse(process.env.FLEET_EXPECT || "{}");
const SHOTS = process.env.FLEET_SCREENSHOTS;
const WAIT_MS = 20000;

const log = (...a) => console.log(...a);


async function api(path, token = ADMIN, init = {}) {
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  const r = await fetch(`${BASE}${path}`, { ...init, headers: { ...headers, ...(init.headers || {}) } });
  let body = null;
  try { body = await r.json(); } catch { body = null; }
  return { status: r.status, body };
}

const shot = (page, name) => page.screenshot({ path: join(SHOTS, `${name}.png`), fullPage: true });
const text = (page, sel) => page.locator(sel).first().textContent({ timeout: WAIT_MS }).then((t) => (t || "").trim());

async function signIn(page, token) {
  await page.locator("#login").waitFor({ state: "visible", timeout: WAIT_MS });
  await page.fill("#token", token);
  await page.click("#login-form button[type=submit]");
  await page.locator("#main").waitFor({ state: "visible", timeout: WAIT_MS });
}

async function go(page, view) {
  await page.evaluate((v) => { location.hash = `#${v}`; }, view);
  await page.locator(`#view-${view}`).waitFor({ state: "visible", timeout: WAIT_MS });
}

async function confirmDialog(page, shotName) {
  await page.locator("#confirm").waitFor({ state: "visible", timeout: WAIT_MS });
  if (shotName) await shot(page, shotName);
  await page.click("#confirm-ok");
}

const lanes = (n, c) => `${n}|${c}`;
// The page's rendering of an API time (RFC 3339 UTC): "2026-11-30 10:48:01.123 UTC".
const iso = (t) => (t ? t.replace("T", " ").replace(/Z$/, " UTC") : "–");

/** The datetime attribute and text of the <time> in `cell`, or [null, text] without one. */
async function timeCell(cell) {
  const t = cell.locator("time");
  const text = (await cell.textContent()).trim();
  return (await t.count()) ? [await t.getAttribute("datetime"), text] : [null, text];
}

/** The attempt table of the task page equals the API's attempt log, row by row. */
async function checkAttempts(page, st) {
  const rows = page.locator("#task-attempts tbody tr[data-attempt]");
  eq(await rows.count(), st.attempts.length, `${st.id}: attempt rows`);
  for (let i = 0; i < st.attempts.length; i++) {
    const a = st.attempts[i];
    const row = rows.nth(i);
    const cell = (k) => row.locator(`td[data-k=${k}]`);
    const txt = async (k) => (await cell(k).textContent()).trim();
    eq(await txt("attempt"), String(a.attempt), `${st.id} row ${i} attempt`);
    eq(await txt("worker"), a.worker ?? "–", `${st.id} row ${i} worker`);
    eq(await txt("outcome"), a.outcome, `${st.id} row ${i} outcome`);
    eq(await txt("reason"), a.reason ?? "", `${st.id} row ${i} reason`);
    eq(await txt("error"), a.error ?? "", `${st.id} row ${i} error`);
    eq(await timeCell(cell("started")), a.started_at ? [a.started_at, iso(a.started_at)] : [null, "–"], `${st.id} row ${i} started`);
    eq(await timeCell(cell("finished")), [a.finished_at, iso(a.finished_at)], `${st.id} row ${i} finished`);
  }
}

async function main() {
  const { ctx, close } = await launch("fleet-console-chromium", { width: 1280, height: 800 });
  try {
    await run(ctx);
  } finally {
    await close();
  }
}

async function run(ctx) {
  const page = await ctx.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));

  // ---- 1. No token: the prompt and nothing else.
  eq((await api("/v1/workers", null)).status, 401, "GET /v1/workers without a token");
  await page.goto(`${BASE}/ui`);
  await page.locator("#login").waitFor({ state: "visible", timeout: WAIT_MS });
  for (const sel of ["#main", "#nav", "#live"]) eq(await page.locator(sel).isVisible(), false, `${sel} visible without a token`);
  const body = await page.locator("body").innerText();
  for (const id of [...EXPECT.workers, EXPECT.busy_group, EXPECT.stays_dead]) if (body.includes(id)) fail(`page without a token shows ${id}`);
  await shot(page, "01-login");
  log("ok: without a token the page shows only the prompt");

  // A wrong token is refused and the prompt says so.
  await page.fill("#token", "not-a-valid-token-at-all");
  await page.click("#login-form button[type=submit]");
  await until("the refusal message", async () => (await page.locator("#login-error").isVisible()) && (await text(page, "#login-error")).includes("refused"));
  eq(await page.locator("#main").isVisible(), false, "main after a wrong token");

  // ---- 2. A read token looks but cannot drain.
  await signIn(page, READ);
  await go(page, "workers");
  const readRow = page.locator(`tr[data-worker="${EXPECT.drain_worker}"]`);
  await readRow.waitFor({ timeout: WAIT_MS });
  await readRow.locator("button.drain").click();
  await confirmDialog(page);
  await until("the 403 notice", async () => (await text(page, "#notice")).includes("role"));
  eq((await api("/v1/workers")).body.find((w) => w.id === EXPECT.drain_worker)?.state, "active", "worker state after a read token's drain");
  log("ok: a read token cannot drain (403 shown)");
  await page.click("#signout");
  await signIn(page, ADMIN);

  // ---- 3. Overview: pressure as the API has it, charts filled.
  await go(page, "overview");
  await until("pressure figures equal to the API's", async () => {
    const p = (await api("/v1/pressure")).body;
    eq(await text(page, "#pressure-state"), p.state, "pressure state");
    eq(await text(page, "#p-waiting"), `${p.waiting.toLocaleString("en-US")} / ${p.thresholds.max_pending.toLocaleString("en-US")}`, "waiting beyond the rooms");
    eq(await text(page, "#p-pending"), p.pending.toLocaleString("en-US"), "pending");
    eq(await text(page, "#p-load"), `${p.running} / ${p.capacity} (${(p.load * 100).toFixed(0)}%, ${p.load_level})`, "load");
    // One state: the badge and the intake line say the same thing (no red badge beside an open gate).
    eq(await text(page, "#p-intake"), { green: "open", yellow: "throttled", red: "closed" }[p.state], "intake");
    eq(p.gate, p.state, "the API's gate is the state");
    eq(await text(page, "#p-parked"), String(p.parked), "parked");
    eq(await text(page, "#p-reserved"), String(p.reserved), "reserved");
    eq([p.running, p.capacity], [1, 7], "pressure: beta's one running task, 4+2+1 capacity");
    return true;
  });
  await until("throughput chart lines", async () => (await page.locator("#chart-throughput polyline").count()) === 4);
  await until("wait-time chart line", async () => (await page.locator("#chart-wait polyline").count()) >= 1);
  await until("refusals chart", async () => (await page.locator("#chart-refused [data-series=refused] b").count()) === 1);
  await shot(page, "02-overview");
  log("ok: overview shows the API's pressure and the charts");

  // ---- 4. Groups: sorted by backlog, every figure as the API has it.
  await go(page, "groups");
  await until("groups equal to the API's", async () => {
    const groups = (await api("/v1/groups")).body;
    eq(groups.length, 2, "groups in the API");
    const order = await page.locator("#groups-table tbody tr").evaluateAll((rows) => rows.map((r) => r.dataset.group));
    eq(order, [EXPECT.busy_group, EXPECT.idle_group], "group order (largest backlog first)");
    for (const g of groups) {
      const row = page.locator(`tr[data-group="${g.group}"]`);
      const cell = (k) => row.locator(`td[data-k=${k}]`).textContent().then((t) => t.trim());
      eq(await cell("workers"), String(g.workers), `${g.group} workers`);
      eq(await cell("capacity"), lanes(g.capacity, g.critical_capacity), `${g.group} capacity`);
      eq(await cell("load"), lanes(g.load, g.critical_load), `${g.group} load`);
      eq(await cell("reserved"), lanes(g.reserved, g.critical_reserved), `${g.group} reserved`);
      eq(await cell("backlog"), String(g.backlog), `${g.group} backlog`);
      eq(await cell("parked"), lanes(g.parked, g.parked_critical), `${g.group} parked`);
    }
    const busy = groups.find((g) => g.group === EXPECT.busy_group);
    eq([busy.workers, busy.capacity, busy.load, busy.backlog >= 1], [1, 1, 1, true], "beta's figures (busy, with a backlog)");
    const idle = groups.find((g) => g.group === EXPECT.idle_group);
    eq([idle.workers, idle.capacity, idle.backlog], [2, 6, 0], "alpha's figures");
    return true;
  });
  await until("a probe result", async () => (await page.locator(`tr[data-group="${EXPECT.busy_group}"] td[data-k=probe] .badge`).count()) === 1);
  await shot(page, "03-groups");
  log("ok: groups sorted by backlog with the API's figures");

  // ---- 5. Workers: figures as the API has them; drain one with the button and see it leave.
  await go(page, "workers");
  await until("workers equal to the API's", async () => {
    const workers = (await api("/v1/workers")).body;
    eq(workers.map((w) => w.id).sort(), [...EXPECT.workers].sort(), "workers in the API");
    for (const w of workers) {
      const row = page.locator(`tr[data-worker="${w.id}"]`);
      const cell = (k) => row.locator(`td[data-k=${k}]`).textContent().then((t) => t.trim());
      eq(await cell("state"), w.state, `${w.id} state`);
      eq(await cell("running"), lanes(`${w.running}/${w.capacity}`, `${w.running_critical}/${w.critical_capacity}`), `${w.id} running`);
      eq(await cell("succeeded"), w.succeeded.toLocaleString("en-US"), `${w.id} succeeded`);
      // One definition of failed everywhere: attempts whose handler failed, retried + dead.
      eq(w.failed, w.retried + w.dead, `${w.id}: the API's failed is retried + dead`);
      eq(await cell("failed"), w.failed.toLocaleString("en-US"), `${w.id} failed`);
      eq(await cell("unrecorded"), w.unrecorded.toLocaleString("en-US"), `${w.id} unrecorded`);
      if (typeof w.clock_skew_ms !== "number") fail(`${w.id}: no clock_skew_ms in the API`);
      if (!/^-?\d+ ms$/.test(await cell("skew"))) fail(`${w.id} skew cell: ${await cell("skew")}`);
    }
    // alpha ran the four failing attempts (two flaky tasks once each, the exhausted task twice):
    // the Failed cells of its workers add up to them (the column once showed 0 for a worker
    // whose every task failed).
    const failedCells = [];
    for (const w of workers.filter((w) => w.group === EXPECT.idle_group)) {
      failedCells.push(Number((await page.locator(`tr[data-worker="${w.id}"] td[data-k=failed]`).textContent()).trim().replace(/,/g, "")));
    }
    eq(failedCells.reduce((s, n) => s + n, 0), 4, `alpha's Failed cells (${failedCells})`);
    // One source for running: each group's load (API) is its workers' running (API and page).
    const groups = (await api("/v1/groups")).body;
    for (const g of groups) {
      const mine = workers.filter((w) => w.group === g.group);
      eq(mine.reduce((s, w) => s + w.running, 0), g.load, `${g.group}: its workers' running = its load`);
      let shown = 0;
      for (const w of mine) shown += Number((await page.locator(`tr[data-worker="${w.id}"] td[data-k=running]`).textContent()).trim().split("/")[0]);
      eq(shown, g.load, `${g.group}: the Running cells add up to its load`);
    }
    const done = workers.filter((w) => w.group === EXPECT.idle_group).reduce((s, w) => s + w.succeeded, 0);
    eq(done >= 20, true, `alpha's succeeded total (${done}) covers the 20 echo tasks`);
    return true;
  });
  await shot(page, "04-workers");
  await page.locator(`tr[data-worker="${EXPECT.drain_worker}"] button.drain`).click();
  await confirmDialog(page, "05-drain-confirm");
  await until("the drained worker to leave the page", async () => (await page.locator(`tr[data-worker="${EXPECT.drain_worker}"]`).count()) === 0, 30000);
  eq((await api("/v1/workers")).body.some((w) => w.id === EXPECT.drain_worker), false, "drained worker still in the API");
  log("ok: drained a worker with the button; it left");

  // ---- 6. Dead letters: list, filter, view, replay one and a selection.
  await go(page, "dead");
  const listing = (await api("/v1/dead")).body;
  eq(listing.depth, 3, "dead letters in the API");
  await until("three dead letters on the page", async () => (await page.locator("#dead-table tbody tr[data-task]").count()) === 3);
  for (const d of listing.letters) {
    const row = page.locator(`tr[data-task="${d.id}"]`);
    const cell = (k) => row.locator(`td[data-k=${k}]`).textContent().then((t) => t.trim());
    eq(await cell("reason"), d.reason, `${d.id} reason`);
    eq(await cell("kind"), d.kind, `${d.id} kind`);
    eq(await cell("attempts"), String(d.attempts), `${d.id} attempts`);
    eq(await cell("worker"), d.worker, `${d.id} worker`);
    eq(await cell("detail"), d.detail, `${d.id} detail`);
  }
  eq(listing.letters.find((d) => d.id === EXPECT.stays_dead)?.reason, "max_attempts", "reason of the exhausted task");
  await page.selectOption("#dead-reason", "permanent_error");
  await until("the reason filter", async () => {
    const ids = await page.locator("#dead-table tbody tr[data-task]").evaluateAll((rows) => rows.map((r) => r.dataset.task).sort());
    eq(ids, [EXPECT.replay_one, EXPECT.replay_selected].sort(), "rows with reason permanent_error");
    return true;
  });
  await page.selectOption("#dead-kind", "fail");
  await until("reason and kind filters together", async () => (await text(page, "#dead-table tbody")).includes("No dead letter matches"));
  await page.selectOption("#dead-kind", "");
  await until("the kind filter cleared", async () => (await page.locator("#dead-table tbody tr[data-task]").count()) === 2);
  await shot(page, "06-dead-letters");
  await page.locator(`tr[data-task="${EXPECT.replay_one}"] button.view`).click();
  await page.locator("#envelope").waitFor({ state: "visible", timeout: WAIT_MS });
  const env = await text(page, "#envelope-body");
  for (const s of [EXPECT.replay_one, '"kind": "flaky"', "downstream refused the request"]) if (!env.includes(s)) fail(`envelope view lacks ${s}`);
  await shot(page, "07-dead-letter-envelope");
  await page.click("#envelope button[value=close]");

  await page.locator(`tr[data-task="${EXPECT.replay_one}"] button.replay`).click();
  await confirmDialog(page, "08-replay-confirm");
  await until("the replayed letter to leave the list", async () => (await page.locator(`tr[data-task="${EXPECT.replay_one}"]`).count()) === 0);
  if (!(await text(page, "#notice")).startsWith("Replayed 1")) fail(`notice after a replay: ${await text(page, "#notice")}`);
  await page.locator(`tr[data-task="${EXPECT.replay_selected}"] input.pick`).check();
  eq(await text(page, "#dead-replay-selected"), "Replay selected (1)", "selection button");
  await page.click("#dead-replay-selected");
  await confirmDialog(page);
  await until("the selected letter to leave the list", async () => (await page.locator(`tr[data-task="${EXPECT.replay_selected}"]`).count()) === 0);
  for (const id of [EXPECT.replay_one, EXPECT.replay_selected]) {
    await until(`${id} to succeed after its replay`, async () => (await api(`/v1/tasks/${id}`)).body?.state === "succeeded");
  }
  await page.selectOption("#dead-reason", "");
  await until("one dead letter left", async () => (await page.locator("#dead-table tbody tr[data-task]").count()) === 1);
  eq((await api("/v1/dead")).body.letters.map((d) => d.id), [EXPECT.stays_dead], "dead letters left in the API");
  log("ok: replayed one dead letter and a selection; both succeeded");

  // ---- 7. Task lookup.
  await go(page, "task");
  // The attempt log: the replayed task died once (permanent error) and then succeeded; the
  // exhausted one failed, then died of max_attempts.
  const history = [
    [EXPECT.replay_one, "succeeded", [[1, "dead", "permanent_error"], [1, "succeeded", undefined]]],
    [EXPECT.stays_dead, "dead", [[1, "failed", undefined], [2, "dead", "max_attempts"]]],
  ];
  for (const [id, state, attempts] of history) {
    await page.fill("#task-id", id);
    await page.click("#task-form button[type=submit]");
    const st = (await api(`/v1/tasks/${id}`)).body;
    eq(st.state, state, `API state of ${id}`);
    eq(st.attempts.map((a) => [a.attempt, a.outcome, a.reason]), attempts, `API attempt log of ${id}`);
    if (!st.attempts.every((a) => EXPECT.workers.includes(a.worker) && a.finished_at)) fail(`${id}: attempts without a known worker or end: ${JSON.stringify(st.attempts)}`);
    await until(`the status of ${id}`, async () => {
      eq(await text(page, "#task-fields dd[data-k=id]"), id, "looked-up id");
      eq(await text(page, "#task-fields dd[data-k=state]"), state, `${id} state`);
      eq(await text(page, "#task-fields dd[data-k=attempt]"), String(st.attempt), `${id} attempt`);
      eq(await text(page, "#task-fields dd[data-k=worker]"), st.worker, `${id} worker`);
      await checkAttempts(page, st);
      return true;
    });
    if (state === "succeeded") await shot(page, "09-task-lookup");
    else await shot(page, "09b-task-lookup-attempts");
  }
  await page.fill("#task-id", "no-such-task");
  await page.click("#task-form button[type=submit]");
  await page.locator("#task-missing").waitFor({ timeout: WAIT_MS });
  log("ok: task lookup shows the API's status records and attempt logs");

  // ---- 7b. Schedules: every figure as the API has it; run now, pause, resume by button.
  await go(page, "schedules");
  const S = EXPECT.schedules;
  const checkSchedules = async () => {
    const list = (await api("/v1/schedules")).body;
    eq(list.map((s) => s.name).sort(), [S.active, S.paused].sort(), "schedules in the API");
    const order = await page.locator("#schedules-table tbody tr").evaluateAll((rows) => rows.map((r) => r.dataset.schedule));
    eq(order, list.map((s) => s.name).sort(), "schedule rows (by name)");
    for (const s of list) {
      const row = page.locator(`tr[data-schedule="${s.name}"]`);
      const cell = (k) => row.locator(`td[data-k=${k}]`);
      const txt = async (k) => (await cell(k).textContent()).trim();
      eq(await txt("cron"), s.cron, `${s.name} cron`);
      eq(await txt("timezone"), s.timezone, `${s.name} timezone`);
      eq(await txt("state"), s.enabled ? "active" : "paused", `${s.name} state`);
      eq(await timeCell(cell("next")), s.next_tick ? [s.next_tick, iso(s.next_tick)] : [null, "–"], `${s.name} next tick`);
      eq(await timeCell(cell("last")), s.last_tick ? [s.last_tick, iso(s.last_tick)] : [null, "–"], `${s.name} last tick`);
      const link = cell("last-run").locator("a.task-link");
      if (s.last_outcome === "fired") {
        eq(await link.getAttribute("data-task"), s.last_task.id, `${s.name} last task`);
        eq((await cell("last-run").locator("[data-k=last-state]").textContent()).trim(), s.last_task.state ?? "no status", `${s.name} last task state`);
      } else {
        eq(await link.count(), 0, `${s.name} has no last task`);
        eq(await txt("last-run"), s.last_outcome ?? "–", `${s.name} last run`);
      }
      eq(await txt("task"), `${s.task.kind} (${Object.entries(s.task.labels).map(([k, v]) => `${k}=${v}`).join(", ")})`, `${s.name} task`);
      eq(await txt("missed"), s.missed === "catch_up" ? `catch up (max ${s.catch_up_max})` : s.missed, `${s.name} missed-tick policy`);
      eq(await row.locator(s.enabled ? "button.pause" : "button.resume").count(), 1, `${s.name} pause/resume button`);
    }
    return list;
  };
  let list = await until("schedules equal to the API's", checkSchedules);
  const active = list.find((s) => s.name === S.active), paused = list.find((s) => s.name === S.paused);
  eq([active.enabled, active.next_tick !== null, active.last_tick, active.last_outcome, active.last_task], [true, true, null, null, null], "nightly: due later, never fired");
  eq([paused.enabled, paused.next_tick, paused.last_outcome, paused.last_task.id, paused.last_task.state], [false, null, "fired", S.paused_task, "succeeded"], "every-second: paused after a successful tick");
  eq([active.missed, paused.missed, paused.catch_up_max, active.timezone, paused.timezone], ["skip", "catch_up", 2, "Europe/Berlin", "UTC"], "definitions as added");
  if (!/T03:00:00\+01:00|T02:00:00Z|T01:00:00Z/.test(active.next_tick)) fail(`nightly's next tick is not 03:00 in Berlin: ${active.next_tick}`);
  await shot(page, "15-schedules");
  // The whole table fits a 1280 px window (it was cut at 1400 px: ten columns that never wrapped).
  const fit = await page.locator("#schedules-table").evaluate((t) => [t.scrollWidth, t.parentElement.clientWidth]);
  if (fit[0] > fit[1]) fail(`the schedules table is ${fit[0]} px wide in a ${fit[1]} px frame at 1280 px`);

  // Run now: one task at once, id <name>@<now>; it succeeds.
  await page.locator(`tr[data-schedule="${S.active}"] button.run-now`).click();
  await confirmDialog(page, "16-run-now-confirm");
  const fired = await until("the run-now notice", async () => {
    const m = (await text(page, "#notice")).match(/^Schedule nightly fired: task (\S+)\.$/);
    return m ? m[1] : undefined;
  });
  if (!fired.startsWith(`${S.active}@`)) fail(`run-now task id ${fired}`);
  await until(`${fired} to succeed`, async () => (await api(`/v1/tasks/${encodeURIComponent(fired)}`)).body?.state === "succeeded");
  // Pause and resume by button; the API agrees after each, and so does the page.
  await page.locator(`tr[data-schedule="${S.active}"] button.pause`).click();
  await confirmDialog(page);
  await until("nightly paused", async () => (await api(`/v1/schedules/${S.active}`)).body.enabled === false);
  list = await until("the page to show nightly paused", async () => {
    const l = await checkSchedules();
    return l.find((s) => s.name === S.active).next_tick === null ? l : undefined;
  });
  await page.locator(`tr[data-schedule="${S.active}"] button.resume`).click();
  await confirmDialog(page);
  await until("nightly resumed", async () => (await api(`/v1/schedules/${S.active}`)).body.enabled === true);
  await until("the page to show nightly resumed", async () => {
    const l = await checkSchedules();
    return l.find((s) => s.name === S.active).next_tick !== null ? l : undefined;
  });
  eq((await api(`/v1/schedules/${S.active}`)).body.last_outcome, null, "run now is not a tick");
  // The last run's link opens its task with its attempt log.
  await go(page, "schedules");
  await page.locator(`tr[data-schedule="${S.paused}"] a.task-link`).click();
  await page.locator("#view-task").waitFor({ state: "visible", timeout: WAIT_MS });
  const pst = (await api(`/v1/tasks/${encodeURIComponent(S.paused_task)}`)).body;
  eq([pst.state, pst.attempts.map((a) => a.outcome)], ["succeeded", ["succeeded"]], `${S.paused_task} status and attempts`);
  await until(`the task page of ${S.paused_task}`, async () => {
    eq(await text(page, "#task-fields dd[data-k=id]"), S.paused_task, "task opened from the schedule");
    await checkAttempts(page, pst);
    return true;
  });
  log("ok: schedules show the API's definitions, ticks and last runs; run now, pause and resume work");

  // ---- 8. Phone width and dark theme.
  await page.setViewportSize({ width: 390, height: 844 });
  for (const view of ["overview", "groups", "schedules"]) {
    await go(page, view);
    await page.waitForTimeout(300);
    const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
    if (overflow > 1) fail(`${view} is ${overflow}px wider than a phone screen`);
    await shot(page, `10-phone-${view}`);
  }
  await page.setViewportSize({ width: 1280, height: 800 });
  await page.emulateMedia({ colorScheme: "dark" });
  await go(page, "overview");
  const bg = await page.evaluate(() => getComputedStyle(document.body).backgroundColor);
  const [r, g, b] = bg.match(/\d+/g).map(Number);
  if (r + g + b > 150) fail(`dark theme background is ${bg}`);
  await shot(page, "11-dark-overview");
  await go(page, "workers");
  await shot(page, "12-dark-workers");
  log("ok: phone width without horizontal scrolling; dark theme");

  // ---- 9. The scheduler goes away: the banner says so.
  console.log("@stop-scheduler");
  const openBase = (await waitForLine("stopped")).split(" ")[1];
  await page.locator("#unreachable").waitFor({ state: "visible", timeout: WAIT_MS });
  if (!(await text(page, "#unreachable")).includes("unreachable")) fail("banner text");
  await shot(page, "13-unreachable");
  log("ok: the unreachable banner shows when the scheduler is down");

  // ---- 10. A scheduler without tokens: no prompt, the fleet at once.
  const open = await ctx.newPage();
  await open.emulateMedia({ colorScheme: "light" });
  await open.goto(`${openBase}/ui#workers`);
  await open.locator("#main").waitFor({ state: "visible", timeout: WAIT_MS });
  eq(await open.locator("#login").isVisible(), false, "prompt on an open API");
  eq(await open.locator("#signout").isVisible(), false, "forget-token link without a token");
  const live = EXPECT.workers.filter((w) => w !== EXPECT.drain_worker).sort();
  await until("the open API's workers", async () => {
    eq((await open.locator("#workers-table tbody tr[data-worker]").evaluateAll((rows) => rows.map((r) => r.dataset.worker))).sort(), live, "workers on the open page");
    return true;
  });
  await shot(open, "14-open-api-workers");
  log("ok: without tokens configured the page needs none");

  if (errors.length) fail(`errors in the page: ${errors.join("; ")}`);
}

/** Resolves with the first stdin line starting with `want`. */
function waitForLine(want) {
  return new Promise((resolve, reject) => {
    const rl = createInterface({ input: process.stdin });
    const t = setTimeout(() => { rl.close(); reject(new Error(`no "${want}" on stdin`)); }, 60000);
    rl.on("line", (l) => { if (l.trim().startsWith(want)) { clearTimeout(t); rl.close(); resolve(l.trim()); } });
  });
}

main().then(() => process.exit(0), (e) => { console.error(`FAILED: ${e.stack || e}`); process.exit(1); });
