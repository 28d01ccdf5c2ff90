// Browser half of the console test in tests/tests/e2e/pause.rs: pauses and resumes a group and
// a kind with the console's buttons (headless Debian chromium, playwright-core) and checks that
// the page's badge and the API agree at every step. Environment (set by the Rust test):
//   FLEET_UI_BASE       scheduler base URL, e.g. http://127.0.0.1:PORT
//   FLEET_ADMIN_TOKEN   token with role admin
//   FLEET_EXPECT        JSON: {group, kind}
//   FLEET_SCREENSHOTS   directory for the screenshots (pause-*.png)
//   CHROMIUM            browser binary (default /usr/bin/chromium)
// Exits non-zero on the first failed check.

import { join } from "node:path";
import { eq, fail, launch, until } from "./lib.mjs";

const BASE = process.env.FLEET_UI_BASE;
const ADMIN = process.env.FLEET_ADMIN_TOKEN;
const EXPECT = JSON.parse(process.env.FLEET_EXPECT || "{}");
const SHOTS = process.env.FLEET_SCREENSHOTS;
const WAIT_MS = 20000;

const log = (...a) => console.log(...a);


async function api(path) {
  const r = await fetch(`${BASE}${path}`, { headers: { Authorization: `Bearer ${ADMIN}` } });
  return { status: r.status, body: await r.json() };
}

const shot = (page, name) => page.screenshot({ path: join(SHOTS, `pause-${name}.png`), fullPage: true });

async function confirm(page, name) {
  await page.locator("#confirm").waitFor({ state: "visible", timeout: WAIT_MS });
  if (name) await shot(page, name);
  await page.click("#confirm-ok");
}

/** The API's pause state of the group: [paused, paused_lanes] from GET /v1/groups, and whether
 *  GET /v1/pauses lists it. */
async function apiGroup() {
  const g = (await api("/v1/groups")).body.find((x) => x.group === EXPECT.group);
  const listed = (await api("/v1/pauses")).body.pauses.some((p) => p.scope === "group" && p.group === EXPECT.group);
  return [g.paused, g.paused_lanes, listed];
}

async function run(ctx) {
  const page = await ctx.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  await page.goto(`${BASE}/ui`);
  await page.locator("#login").waitFor({ state: "visible", timeout: WAIT_MS });
  await page.fill("#token", ADMIN);
  await page.click("#login-form button[type=submit]");
  await page.locator("#main").waitFor({ state: "visible", timeout: WAIT_MS });
  await page.evaluate(() => { location.hash = "#groups"; });
  const row = page.locator(`#groups-table tbody tr[data-group="${EXPECT.group}"]`);
  const cell = row.locator('td[data-k="pause"]');

  // 1. Running: a Pause button, no badge; the API agrees.
  await cell.locator("button.pause").waitFor({ state: "visible", timeout: WAIT_MS });
  eq(await cell.locator(".badge").count(), 0, "no paused badge on a running group");
  eq(await apiGroup(), [false, [], false], "the API before the pause");
  await shot(page, "1-running");
  log("ok: a running group shows Pause");

  // 2. Pause with the button: the badge shows, and the API says paused.
  await cell.locator("button.pause").click();
  await confirm(page, "2-confirm");
  await until("the paused badge", async () => (await cell.locator(".badge.paused").count()) === 1);
  eq(await apiGroup(), [true, ["normal", "critical"], true], "the API after the pause");
  const badge = (await cell.locator(".badge.paused").textContent()).trim();
  if (!badge.startsWith("paused")) fail(`badge text: ${badge}`);
  await cell.locator("button.resume").waitFor({ state: "visible", timeout: WAIT_MS });
  await shot(page, "3-paused");
  log(`ok: paused with the button; badge "${badge}"`);

  // 3. Pause a kind with the form: it is listed with its held tasks, as the API has it.
  await page.fill("#kind-pause-name", EXPECT.kind);
  await page.fill("#kind-pause-reason", "console test");
  await page.click("#kind-pause-form button[type=submit]");
  await confirm(page);
  const kindRow = page.locator(`#kind-pauses-table tbody tr[data-kind="${EXPECT.kind}"]`);
  await kindRow.waitFor({ state: "visible", timeout: WAIT_MS });
  const kinds = (await api("/v1/pauses")).body.pauses.filter((p) => p.scope === "kind");
  eq(kinds.map((p) => [p.kind, p.reason]), [[EXPECT.kind, "console test"]], "kind pauses in the API");
  await shot(page, "4-kind-paused");
  log("ok: paused a kind with the form");

  // 4. Resume both with their buttons: badges gone, the API empty.
  await kindRow.locator("button.resume").click();
  await confirm(page);
  await until("the kind resumed", async () => (await kindRow.count()) === 0);
  await cell.locator("button.resume").click();
  await confirm(page);
  await until("the badge gone", async () => (await cell.locator(".badge.paused").count()) === 0 && (await cell.locator("button.pause").count()) === 1);
  eq(await apiGroup(), [false, [], false], "the API after the resume");
  eq((await api("/v1/pauses")).body.pauses, [], "no pause left");
  await shot(page, "5-resumed");
  log("ok: resumed the kind and the group with their buttons");
  eq(errors, [], "page errors");
}

async function main() {
  const { ctx, close } = await launch("fleet-pause-chromium", { width: 1280, height: 800 });
  try {
    await run(ctx);
  } finally {
    await close();
  }
}

main().then(() => log("pause console: all checks passed"), (e) => { console.error(`pause console: FAILED: ${e.message}`); process.exit(1); });
