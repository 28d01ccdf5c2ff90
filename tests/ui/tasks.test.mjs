// Browser half of the `tasks::console_tasks_page_filters_counts_and_bulk_cancel` test
// (tests/tests/e2e/tasks.rs): drives the console's Tasks page in Debian's chromium with
// playwright-core and checks it against the API. Environment (set by the Rust test):
//   FLEET_UI_BASE       scheduler base URL, e.g. http://127.0.0.1:PORT
//   FLEET_ADMIN_TOKEN   token with role admin
//   FLEET_EXPECT        JSON: group (the busy group), kind (the waiting tasks' kind), waiting
//                       (how many of that kind wait in that group)
//   FLEET_SCREENSHOTS   directory for the screenshots
//   CHROMIUM            browser binary (default /usr/bin/chromium)
// Prints "picked ID1 ID2" (the two tasks it cancelled by selection) and "done"; exits
// non-zero on the first failed check.

import { join } from "node:path";
import { eq, fail, launch, until } from "./lib.mjs";

const BASE = process.env.FLEET_UI_BASE;
const ADMIN = process.env.FLEET_ADMIN_TOKEN;
const EXPECT = JSON.parse(process.env.FLEET_EXPECT || "{}");
const SHOTS = process.env.FLEET_SCREENSHOTS;
const WAIT_MS = 20000;
const STATES = ["queued", "parked", "delayed", "waiting_for_worker", "waiting", "retrying", "running", "succeeded", "dead", "expired", "cancelled"];

const log = (...a) => console.log(...a);


async function api(path, init = {}) {
  const r = await fetch(`${BASE}${path}`, { ...init, headers: { Authorization: `Bearer ${ADMIN}`, "Content-Type": "application/json", ...(init.headers || {}) } });
  let body = null;
  try { body = await r.json(); } catch { body = null; }
  return { status: r.status, body };
}

const shot = (page, name) => page.screenshot({ path: join(SHOTS, `${name}.png`), fullPage: true });

/** The page's per-state counts (the chips' data-count). */
async function pageCounts(page) {
  return page.evaluate(() => Object.fromEntries([...document.querySelectorAll("#tasks-counts .chip")].map((c) => [c.dataset.state, Number(c.dataset.count)])));
}

/** The API's per-state counts for a filter, in the chips' order. */
async function apiCounts(filter) {
  const r = await api(`/v1/tasks?${new URLSearchParams({ ...filter, limit: "1" })}`);
  eq(r.status, 200, "GET /v1/tasks");
  return Object.fromEntries(STATES.map((s) => [s, r.body.counts[s] ?? 0]));
}

/** Waits until the page's counts equal the API's for `filter` (both read after the change). */
async function countsAgree(page, filter, what) {
  return until(`${what}: the page's counts equal the API's`, async () => {
    const [p, a] = [await pageCounts(page), await apiCounts(filter)];
    return JSON.stringify(p) === JSON.stringify(a) ? a : undefined;
  });
}

async function rowIds(page) {
  return page.evaluate(() => [...document.querySelectorAll("#tasks-table tbody tr[data-task]")].map((r) => r.dataset.task));
}

async function main() {
  const { ctx: browser, close } = await launch("fleet-tasks-chromium", { width: 1400, height: 900 });
  const errors = [];
  try {
    const page = await browser.newPage();
    page.on("pageerror", (e) => errors.push(String(e)));
    await page.goto(`${BASE}/ui`);
    await page.locator("#login").waitFor({ state: "visible", timeout: WAIT_MS });
    await page.fill("#token", ADMIN);
    await page.click("#login-form button[type=submit]");
    await page.locator("#main").waitFor({ state: "visible", timeout: WAIT_MS });

    // 1. The Tasks page from the nav: every task, counts as the API has them.
    await page.click('#nav a[data-view="tasks"]');
    await page.locator("#view-tasks").waitFor({ state: "visible", timeout: WAIT_MS });
    const all = await countsAgree(page, {}, "no filter");
    log(`all counts ${JSON.stringify(all)}`);
    await shot(page, "tasks-all");

    // 2. From the groups view: the busy group's name opens Tasks filtered by it.
    await page.click('#nav a[data-view="groups"]');
    await page.locator(`#groups-table tr[data-group="${EXPECT.group}"] a.tasks-link`).click({ timeout: WAIT_MS });
    await page.locator("#view-tasks").waitFor({ state: "visible", timeout: WAIT_MS });
    eq(await page.inputValue("#tasks-group"), EXPECT.group, "group filter from the groups view");
    await countsAgree(page, { group: EXPECT.group }, "group filter");

    // 3. Kind filter typed in: every row is of that kind, counts agree, 50 per page.
    await page.fill("#tasks-kind", EXPECT.kind);
    await page.click("#tasks-form button[type=submit]");
    const byKind = await countsAgree(page, { group: EXPECT.group, kind: EXPECT.kind }, "group + kind");
    eq(byKind.queued + byKind.parked, EXPECT.waiting, "waiting tasks of the kind");
    const kinds = await until("rows of the kind", async () => {
      const k = await page.evaluate(() => [...document.querySelectorAll('#tasks-table tbody td[data-k="kind"]')].map((td) => td.textContent));
      return k.length === 50 ? k : undefined;
    });
    if (kinds.some((k) => k !== EXPECT.kind)) fail(`a row of another kind: ${kinds}`);
    const first = await rowIds(page);
    await page.click("#tasks-older");
    const second = await until("page 2", async () => { const r = await rowIds(page); return r.length && r[0] !== first[0] ? r : undefined; });
    if (second.some((id) => first.includes(id))) fail("page 2 repeats a task of page 1");
    await page.click("#tasks-newer");
    await until("page 1 again", async () => ((await rowIds(page))[0] === first[0] ? true : undefined));
    await shot(page, "tasks-filtered");

    // 4. Select two rows, bulk cancel: the confirm dialog shows the dry run (2, both ids).
    const picked = first.slice(0, 2);
    for (const id of picked) await page.check(`#tasks-table tr[data-task="${id}"] input.pick`);
    eq(await page.textContent("#tasks-selection"), "2 selected", "selection");
    await page.click("#tasks-cancel");
    await page.locator("#confirm").waitFor({ state: "visible", timeout: WAIT_MS });
    const t1 = await page.textContent("#confirm-text");
    if (!t1.startsWith("Cancel 2 task(s)?") || !picked.every((id) => t1.includes(id))) fail(`dialog: ${t1}`);
    await shot(page, "tasks-confirm-selected");
    await page.click("#confirm-ok");
    await until("the notice of 2 cancelled", async () => ((await page.textContent("#notice")).includes("cancel: 2 applied, 0 skipped, 0 failed") ? true : undefined));
    for (const id of picked) eq((await api(`/v1/tasks/${id}`)).body.state, "cancelled", `${id} after the cancel`);
    log(`picked ${picked.join(" ")}`);

    // 5. Select all matching, bulk cancel: the dialog's count is the API's dry run and the
    //    page's count of tasks not yet ended.
    const before = await countsAgree(page, { group: EXPECT.group, kind: EXPECT.kind }, "after the 2");
    const open = ["queued", "parked", "delayed", "waiting_for_worker", "waiting", "retrying", "running"].reduce((n, s) => n + before[s], 0);
    const dry = await api("/v1/tasks/bulk", { method: "POST", body: JSON.stringify({ action: "cancel", query: { group: EXPECT.group, kind: EXPECT.kind }, dry_run: true }) });
    eq(dry.body.count, open, "API dry-run count = the page's open tasks");
    await page.click("#tasks-select-matching");
    await page.click("#tasks-cancel");
    await page.locator("#confirm").waitFor({ state: "visible", timeout: WAIT_MS });
    const t2 = await page.textContent("#confirm-text");
    if (!t2.startsWith(`Cancel ${open} task(s)?`)) fail(`dialog: ${t2} (expected ${open})`);
    await shot(page, "tasks-confirm-all");
    await page.click("#confirm-ok");
    await until(`the notice of ${open} cancelled`, async () => ((await page.textContent("#notice")).includes(`cancel: ${open} applied, 0 skipped, 0 failed`) ? true : undefined));
    const after = await countsAgree(page, { group: EXPECT.group, kind: EXPECT.kind }, "after all");
    eq(after.cancelled, EXPECT.waiting, "every waiting task of the kind cancelled");
    await shot(page, "tasks-after");
    eq(errors, [], "page errors");
    log("done");
  } finally {
    await close();
  }
}

main().catch((e) => { console.error(`FAIL: ${e.message}`); process.exit(1); });
