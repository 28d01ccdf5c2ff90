// Browser half of the console test in tests/tests/e2e/keys_api.rs: the Keys view in headless
// Debian chromium (playwright-core) — the settings' keys as the API has them, a limit set with
// the form shows in the table (and in the API), a key paused with its button. Environment (set
// by the Rust test):
//   FLEET_UI_BASE       scheduler base URL, e.g. http://127.0.0.1:PORT
//   FLEET_ADMIN_TOKEN   token with role admin
//   FLEET_SCREENSHOTS   directory for the screenshots (keys-*.png)
//   CHROMIUM            browser binary (default /usr/bin/chromium)
// Exits non-zero on the first failed check.

import { join } from "node:path";
import { eq, fail, launch, until, WAIT_MS } from "./lib.mjs";

const BASE = process.env.FLEET_UI_BASE;
const ADMIN = process.env.FLEET_ADMIN_TOKEN;
const SHOTS = process.env.FLEET_SCREENSHOTS;
const log = (...a) => console.log(...a);

async function api(path) {
  const r = await fetch(`${BASE}${path}`, { headers: { Authorization: `Bearer ${ADMIN}` } });
  return { status: r.status, body: await r.json() };
}

const shot = (page, name) => page.screenshot({ path: join(SHOTS, `keys-${name}.png`), fullPage: true });

/** The table's rows: [key, max, min, rate, weight, spec, paused]. */
const rows = (page) => page.locator("#keys-table tbody tr[data-key]").evaluateAll((trs) => trs.map((tr) => {
  const c = (k) => (tr.querySelector(`td[data-k="${k}"]`)?.textContent || "").trim();
  return [tr.dataset.key, c("max_running"), c("min_running"), c("rate"), c("weight"), c("source"), c("paused")];
}));

async function run(ctx) {
  const page = await ctx.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  await page.goto(`${BASE}/ui#keys`);
  await page.locator("#login").waitFor({ state: "visible", timeout: WAIT_MS });
  await page.fill("#token", ADMIN);
  await page.click("#login-form button[type=submit]");
  await page.locator("#view-keys").waitFor({ state: "visible", timeout: WAIT_MS });

  // 1. The settings' keys, as the API has them.
  await until("the settings' keys", async () => {
    eq(await rows(page), [["acme", "5", "0", "–", "3", "settings", "–"]], "rows before");
    return true;
  });
  eq((await page.locator("#keys-default").textContent()).trim(), "Default spec (settings): max_running=10", "default line");
  await shot(page, "1-settings");
  log("ok: the Keys view shows the settings' keys");

  // 2. A limit set with the form: the table shows it, and so does the API.
  await page.fill("#keys-key", "beta");
  await page.fill("#keys-max", "4");
  await page.fill("#keys-weight", "2.5");
  await page.fill("#keys-reason", "console test");
  await page.click("#keys-set");
  await until("beta in the table", async () => {
    eq(await rows(page), [["acme", "5", "0", "–", "3", "settings", "–"], ["beta", "4", "0", "–", "2.5", "runtime", "–"]], "rows after");
    return true;
  });
  const beta = (await api("/v1/keys/beta")).body;
  eq([beta.max_running, beta.weight, beta.source, beta.set_by, beta.reason], [4, 2.5, "runtime", "ops", "console test"], "the API's beta");
  await shot(page, "2-set");
  log("ok: a limit set with the form is in the table and the API");

  // 3. Pause beta with its button (confirmed): the badge, and the API says paused.
  const betaRow = page.locator('#keys-table tbody tr[data-key="beta"]');
  await betaRow.locator("button.pause").click();
  await page.locator("#confirm").waitFor({ state: "visible", timeout: WAIT_MS });
  await page.click("#confirm-ok");
  await until("beta's paused badge", async () => (await betaRow.locator(".badge.paused").count()) === 1);
  eq((await api("/v1/keys/beta")).body.paused, true, "the API's beta paused");
  await shot(page, "3-paused");
  log("ok: a key paused with its button");
  if (errors.length) fail(`errors in the page: ${errors.join("; ")}`);
}

async function main() {
  const { ctx, close } = await launch("fleet-keys-chromium", { width: 1400, height: 800 });
  try {
    await run(ctx);
  } finally {
    await close();
  }
}

main().then(() => log("keys console: all checks passed"), (e) => { console.error(`keys console: FAILED: ${e.message}`); process.exit(1); });
