// Browser half of tests/tests/e2e/batch_console.rs: the Batches view in headless Debian
// chromium (playwright-core) shows a batch's progress as the API has it, while two members
// still run and again once the batch is complete. Environment (set by the Rust test):
//   FLEET_UI_BASE       scheduler base URL, e.g. http://127.0.0.1:PORT
//   FLEET_ADMIN_TOKEN   token with role admin
//   FLEET_SCREENSHOTS   directory for the screenshots (batch-*.png)
//   FLEET_BATCH         the batch id
//   FLEET_PHASE_FILE    written once the running state is checked (the test then lets the
//                       two held members finish)
//   CHROMIUM            browser binary (default /usr/bin/chromium)
// Exits non-zero on the first failed check.

import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { eq, fail, launch, until, WAIT_MS } from "./lib.mjs";

const BASE = process.env.FLEET_UI_BASE;
const ADMIN = process.env.FLEET_ADMIN_TOKEN;
const SHOTS = process.env.FLEET_SCREENSHOTS;
const BATCH = process.env.FLEET_BATCH;
const PHASE = process.env.FLEET_PHASE_FILE;
const log = (...a) => console.log(...a);

async function api(path) {
  const r = await fetch(`${BASE}${path}`, { headers: { Authorization: `Bearer ${ADMIN}` } });
  return { status: r.status, body: await r.json() };
}

const shot = (page, name) => page.screenshot({ path: join(SHOTS, `batch-${name}.png`), fullPage: true });

/** What the page shows: its fields (by name), the bar's value and the failed ids. */
const shown = (page) => page.evaluate(() => {
  const f = {};
  for (const dd of document.querySelectorAll("#batch-fields dd")) f[dd.dataset.k] = dd.textContent.trim();
  const bar = document.querySelector("#batch-bar");
  const failed = [...document.querySelectorAll("#batch-failed a")].map((a) => a.textContent.trim());
  return { f, bar: bar ? Number(bar.getAttribute("aria-valuenow")) : -1, max: bar ? Number(bar.getAttribute("aria-valuemax")) : -1, failed };
});

/** The page equals the API's answer for the same moment (read before and after the page: a
 *  change in between is retried by `until`). */
async function matchesApi(page, want) {
  const before = (await api(`/v1/batches/${BATCH}`)).body;
  const s = await shown(page);
  const after = (await api(`/v1/batches/${BATCH}`)).body;
  if (JSON.stringify(before) !== JSON.stringify(after)) return false;
  const b = after;
  const ended = b.total - b.pending;
  eq([b.total, b.succeeded, b.dead, b.pending, b.complete], want, "the API's figures");
  eq(s.f.total, String(b.total), "total");
  for (const k of ["succeeded", "dead", "expired", "cancelled", "pending"]) eq(s.f[k], String(b[k]), k);
  eq(s.f.ended, `${ended} (${Math.floor((100 * ended) / b.total)} %)`, "ended");
  eq(s.f.state, b.complete ? "complete" : "running", "state");
  eq(s.f.callbacks, b.callbacks.map((c) => `${c}${b.fired.includes(c) ? " (fired)" : ""}`).join(", "), "callbacks");
  eq([s.bar, s.max], [ended, b.total], "the progress bar");
  eq(s.failed, b.failed, "the ids that did not succeed");
  return true;
}

async function run(ctx) {
  const page = await ctx.newPage();
  const errors = [];
  page.on("pageerror", (e) => { errors.push(String(e)); log(`page error: ${e}`); });
  // Opened on the Batches view itself: the token prompt first (the view checks the token
  // even with no batch to look up).
  await page.goto(`${BASE}/ui#batch`);
  await page.locator("#login").waitFor({ state: "visible", timeout: WAIT_MS });
  log("step: the token prompt");
  await page.fill("#token", ADMIN);
  await page.click("#login-form button[type=submit]");
  await page.locator("#view-batch").waitFor({ state: "visible", timeout: WAIT_MS });
  log("step: signed in, the Batches view");

  // An unknown batch says so.
  await page.fill("#batch-id", "no-such-batch");
  await page.click("#batch-form button[type=submit]");
  await until("the unknown batch", async () => (await page.locator("#batch-missing").count()) === 1);

  // 1. Two members still held: 5 succeeded, 3 dead, 2 pending, on_complete not fired.
  await page.fill("#batch-id", BATCH);
  await page.click("#batch-form button[type=submit]");
  await until("the running batch as the API has it", () => matchesApi(page, [10, 5, 3, 2, false]));
  eq((await shown(page)).f.callbacks, "on_complete", "not fired yet");
  await shot(page, "1-running");
  log("ok: the running batch's progress is the API's");
  writeFileSync(PHASE, "running checked\n");

  // 2. The held two finish: the page follows (it refreshes every 2 s) to complete.
  await until("the complete batch as the API has it", () => matchesApi(page, [10, 7, 3, 0, true]), 30000);
  eq((await shown(page)).f.callbacks, "on_complete (fired)", "on_complete fired");
  await shot(page, "2-complete");
  log("ok: the complete batch's progress is the API's");

  // 3. A failed member opens its task.
  const first = (await shown(page)).failed[0];
  await page.locator("#batch-failed a").first().click();
  await page.locator("#view-task").waitFor({ state: "visible", timeout: WAIT_MS });
  await until("the failed member's status", async () => {
    const st = await page.locator('#task-fields dd[data-k="state"]').textContent().catch(() => "");
    const id = await page.locator('#task-fields dd[data-k="id"]').textContent().catch(() => "");
    return id.trim() === first && st.trim() === "dead";
  });
  log("ok: a failed member opens its task");
  if (errors.length) fail(`errors in the page: ${errors.join("; ")}`);
}

async function main() {
  const { ctx, close } = await launch("fleet-batch-chromium", { width: 1280, height: 900 });
  try {
    await run(ctx);
  } catch (e) {
    // The page as it was when a check failed, and what it logged.
    for (const p of ctx.pages()) await p.screenshot({ path: join(SHOTS, "batch-failed.png"), fullPage: true }).catch(() => {});
    throw e;
  } finally {
    await close();
  }
}

main().then(() => log("batch console: all checks passed"), (e) => { console.error(`batch console: FAILED: ${e.message}`); process.exit(1); });
