// Browser half of the console test in tests/tests/e2e/batch_control.rs: pauses, resumes and
// cancels a batch with the Batches view's buttons (headless Debian chromium, playwright-core),
// each after its confirm dialog, and checks that the page and the API agree at every step.
// Environment (set by the Rust test):
//   FLEET_UI_BASE       scheduler base URL, e.g. http://127.0.0.1:PORT
//   FLEET_ADMIN_TOKEN   token with role admin
//   FLEET_BATCH         the batch id (its members are held: it stays running)
//   FLEET_SCREENSHOTS   directory for the screenshots (batch-control-*.png)
//   CHROMIUM            browser binary (default /usr/bin/chromium)
// Exits non-zero on the first failed check.

import { join } from "node:path";
import { eq, fail, launch, until, WAIT_MS } from "./lib.mjs";

const BASE = process.env.FLEET_UI_BASE;
const ADMIN = process.env.FLEET_ADMIN_TOKEN;
const BATCH = process.env.FLEET_BATCH;
const SHOTS = process.env.FLEET_SCREENSHOTS;
const log = (...a) => console.log(...a);

async function api(path) {
  const r = await fetch(`${BASE}${path}`, { headers: { Authorization: `Bearer ${ADMIN}` } });
  return { status: r.status, body: await r.json() };
}

const shot = (page, name) => page.screenshot({ path: join(SHOTS, `batch-control-${name}.png`), fullPage: true });

async function confirm(page, name) {
  await page.locator("#confirm").waitFor({ state: "visible", timeout: WAIT_MS });
  if (name) await shot(page, name);
  await page.click("#confirm-ok");
}

/** Whether GET /v1/pauses lists the batch. */
async function apiPaused() {
  return (await api("/v1/pauses")).body.pauses.some((p) => p.scope === "batch" && p.batch === BATCH);
}

async function run(ctx) {
  const page = await ctx.newPage();
  const errors = [];
  page.on("pageerror", (e) => { errors.push(String(e)); log(`page error: ${e}`); });
  await page.goto(`${BASE}/ui#batch`);
  await page.locator("#login").waitFor({ state: "visible", timeout: WAIT_MS });
  await page.fill("#token", ADMIN);
  await page.click("#login-form button[type=submit]");
  await page.locator("#view-batch").waitFor({ state: "visible", timeout: WAIT_MS });
  await page.fill("#batch-id", BATCH);
  await page.click("#batch-form button[type=submit]");

  // 1. Running: Cancel batch and Pause, no badge.
  await page.locator("#batch-pause").waitFor({ state: "visible", timeout: WAIT_MS });
  eq(await page.locator("#batch-cancel").count(), 1, "a Cancel batch button");
  eq(await page.locator("#batch-paused").count(), 0, "no paused badge");
  eq(await apiPaused(), false, "not paused in the API");
  await shot(page, "1-running");
  log("ok: running, with its buttons");

  // 2. Pause (confirmed): the badge, a Resume button, and the API lists the pause.
  await page.click("#batch-pause");
  await confirm(page, "2-confirm-pause");
  await until("the paused badge", async () => (await page.locator("#batch-paused").count()) === 1 && (await page.locator("#batch-resume").count()) === 1);
  eq(await apiPaused(), true, "paused in the API");
  await shot(page, "3-paused");
  log("ok: paused");

  // 3. Resume (confirmed): the Pause button again.
  await page.click("#batch-resume");
  await confirm(page);
  await until("the Pause button again", async () => (await page.locator("#batch-pause").count()) === 1 && (await page.locator("#batch-paused").count()) === 0);
  eq(await apiPaused(), false, "resumed in the API");
  log("ok: resumed");

  // 4. Cancel batch: dismissing the dialog does nothing; confirming cancels it.
  await page.click("#batch-cancel");
  await page.locator("#confirm").waitFor({ state: "visible", timeout: WAIT_MS });
  await page.click("#confirm-cancel");
  eq((await api(`/v1/batches/${BATCH}`)).body.cancel ?? null, null, "not cancelled after dismissing");
  await page.click("#batch-cancel");
  await confirm(page, "4-confirm-cancel");
  await until("the cancelled state", async () => {
    const st = await page.locator('#batch-fields dd[data-k="state"]').textContent().catch(() => "");
    return st.trim() === "cancelled" && (await page.locator("#batch-cancel").count()) === 0;
  });
  const b = (await api(`/v1/batches/${BATCH}`)).body;
  eq(b.cancel?.by, "ops", "cancelled by the token's name");
  eq(b.cancel?.reason, "cancelled from the console", "the console's reason");
  const shown = await page.locator('#batch-fields dd[data-k="cancel"]').textContent();
  if (!shown.includes("by ops")) fail(`the cancel's row: ${shown}`);
  await shot(page, "5-cancelled");
  log("ok: cancelled");
  if (errors.length) fail(`errors in the page: ${errors.join("; ")}`);
}

async function main() {
  const { ctx, close } = await launch("fleet-batch-control-chromium", { width: 1280, height: 900 });
  try {
    await run(ctx);
  } catch (e) {
    for (const p of ctx.pages()) await p.screenshot({ path: join(SHOTS, "batch-control-failed.png"), fullPage: true }).catch(() => {});
    throw e;
  } finally {
    await close();
  }
}

main().then(() => log("batch control console: all checks passed"), (e) => { console.error(`batch control console: FAILED: ${e.message}`); process.exit(1); });
