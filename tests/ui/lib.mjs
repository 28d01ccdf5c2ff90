// What the browser halves of the console tests share (tests/ui/*.test.mjs): checks that fail
// with a message, a bounded poll, and Debian's chromium in a throw-away profile.

import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

/** How long a check may take before it fails (ms). */
export const WAIT_MS = 20000;

export function fail(msg) { throw new Error(msg); }

export function eq(actual, expected, what) {
  if (JSON.stringify(actual) !== JSON.stringify(expected)) fail(`${what}: got ${JSON.stringify(actual)}, expected ${JSON.stringify(expected)}`);
}

/** Polls `check` (returns a value or throws/returns undefined) until it passes or `ms` runs out. */
export async function until(what, check, ms = WAIT_MS) {
  const end = Date.now() + ms;
  let last;
  for (;;) {
    try {
      const v = await check();
      if (v !== undefined && v !== false) return v;
    } catch (e) { last = e; }
    if (Date.now() > end) fail(`timed out after ${ms} ms waiting for ${what}${last ? `: ${last.message}` : ""}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

/** Debian's chromium (or $CHROMIUM), headless, in a fresh profile named after `prefix`;
 *  `close()` ends it and removes the profile. */
export async function launch(prefix, viewport = { width: 1280, height: 800 }) {
  const profile = mkdtempSync(join(tmpdir(), `${prefix}-`));
  const ctx = await chromium.launchPersistentContext(profile, {
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    headless: true,
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"],
    viewport,
    colorScheme: "light",
  });
  return {
    ctx,
    close: async () => {
      await ctx.close();
      rmSync(profile, { recursive: true, force: true });
    },
  };
}
