// Browser half of tests/tests/e2e/audit.rs: the console's Audit view in Debian's chromium
// (playwright-core), checked against GET /v1/audit. Environment (set by the Rust test):
//   FLEET_UI_BASE      scheduler base URL      FLEET_READ_TOKEN   a token with role read
//   FLEET_ADMIN_TOKEN  a token with role admin (named FLEET_EXPECT.by)
//   FLEET_EXPECT       JSON: {"actions": [newest first], "by": token name of the drain,
//                      "cancel": id of a running task the page cancels with its button}
//   FLEET_SCREENSHOTS  directory for the screenshots
//   CHROMIUM           browser binary (default /usr/bin/chromium)
// Exits non-zero on the first failed check.

import { join } from "node:path";
import { eq, fail, launch, until } from "./lib.mjs";

const BASE = process.env.FLEET_UI_BASE;
const READ = process.env.FLEET_READ_TOKEN;
const ADMIN = process.env.FLEET_ADMIN_TOKEN;
const EXPECT = JSON.parse(process.env.FLEET_EXPECT || "{}");
const SHOTS = process.env.FLEET_SCREENSHOTS;
const WAIT_MS = 20000;

async function api(path) {
  const r = await fetch(`${BASE}${path}`, { headers: { Authorization: `Bearer ${READ}` } });
  return { status: r.status, body: await r.json() };
}
const rows = (page) => page.locator("#audit-table tbody tr[data-id]").evaluateAll((trs) => trs.map((tr) => {
  const c = (k) => (tr.querySelector(`td[data-k="${k}"]`)?.textContent || "").trim();
  return { id: tr.dataset.id, action: c("action"), by: c("by"), role: c("role"), count: Number(c("count")), at: tr.querySelector("time")?.getAttribute("datetime") };
}));

async function run(ctx) {
  const page = await ctx.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  await page.goto(`${BASE}/ui#audit`);
  await page.locator("#login").waitFor({ state: "visible", timeout: WAIT_MS });
  await page.fill("#token", READ);
  await page.click("#login-form button[type=submit]");
  await page.locator("#view-audit").waitFor({ state: "visible", timeout: WAIT_MS });
  const api_ = (await api("/v1/audit?limit=200")).body;
  eq(api_.entries.map((e) => e.action), EXPECT.actions, "the API's actions");
  const want = api_.entries.map((e) => ({ id: e.id, action: e.action, by: e.by, role: e.role, count: e.count, at: e.at }));
  await until("the page's rows equal the API's", async () => { eq(await rows(page), want, "audit rows"); return true; });
  eq((await page.locator("#audit-count").textContent()).startsWith(`${want.length} of ${api_.total} shown`), true, "the count line");
  await page.screenshot({ path: join(SHOTS, "audit-1-all.png"), fullPage: true });
  console.log(`ok: the Audit view shows the API's ${want.length} entries`);
  await page.fill("#audit-action", "drain");
  await page.click("#audit-form button[type=submit]");
  await until("only the drain", async () => {
    const r = await rows(page);
    eq(r.map((x) => [x.action, x.by]), [["drain", EXPECT.by]], "filtered rows");
    return true;
  });
  await page.screenshot({ path: join(SHOTS, "audit-2-drain.png"), fullPage: true });
  console.log("ok: filtered by action");
  if (errors.length) fail(`errors in the page: ${errors.join("; ")}`);
  await cancelWithTheButton(page);
}

// An admin cancels a running task with the task page's button: the confirm dialog, then the
// task is cancelled (API) and the audit log's newest entry is that cancel, by the admin's name.
async function cancelWithTheButton(page) {
  await page.click("#signout");
  await page.locator("#login").waitFor({ state: "visible", timeout: WAIT_MS });
  await page.fill("#token", ADMIN);
  await page.click("#login-form button[type=submit]");
  await page.locator("#main").waitFor({ state: "visible", timeout: WAIT_MS });
  await page.evaluate(() => { location.hash = "#task"; });
  await page.locator("#view-task").waitFor({ state: "visible", timeout: WAIT_MS });
  await page.fill("#task-id", EXPECT.cancel);
  await page.click("#task-form button[type=submit]");
  await page.locator("#task-cancel").waitFor({ state: "visible", timeout: WAIT_MS });
  await page.click("#task-cancel");
  await page.locator("#confirm").waitFor({ state: "visible", timeout: WAIT_MS });
  await page.screenshot({ path: join(SHOTS, "audit-3-cancel-confirm.png"), fullPage: true });
  await page.click("#confirm-ok");
  await until("the task cancelled", async () => (await api(`/v1/tasks/${EXPECT.cancel}`)).body.state === "cancelled");
  await until("the page says cancelled", async () => (await page.locator('#task-fields dd[data-k="state"]').textContent()).trim() === "cancelled");
  const newest = (await api("/v1/audit?limit=1")).body.entries[0];
  eq([newest.action, newest.by, newest.target.task, newest.reason], ["cancel", EXPECT.by, EXPECT.cancel, "cancelled from the console"], "the audit entry of the button's cancel");
  await page.screenshot({ path: join(SHOTS, "audit-4-cancelled.png"), fullPage: true });
  console.log("ok: the task page's Cancel button cancelled a running task, and the audit log says who");
}

async function main() {
  const { ctx, close } = await launch("fleet-audit-chromium", { width: 1280, height: 800 });
  try {
    await run(ctx);
  } finally {
    await close();
  }
}

main().then(() => process.exit(0), (e) => { console.error(`FAILED: ${e.stack || e}`); process.exit(1); });
