// The live page in a real headless Chromium (Debian's), driven by playwright-core: click FLAKY-1 and
// see its job reach `succeeded`, click its row and see its story (its four retries included), click
// POISON-1 and see it reach `quarantined` and appear under parking, its story ending parked. Every
// story shown is compared with `GET /jobs/{id}/events` (and its link to the trace with the API's
// `traceUrl`, when there is one), and every state the page shows is compared with what
// `GET /jobs/{id}` says at that moment, so the test fails if the page shows anything but the job's
// real state; and it proves it can fail: the same check against the page fed a tampered
// `/overview` must fail.
//
// The page's data is an operator's (decision 0031): without a token the page shows the 401 and no
// job; with DEMO_OPERATOR_TOKEN in its address (`/#token=…`) it works.
//
// The console of parked messages: POISON-1's message is read with its headers and body, and a dry
// run says its consumer's inbox has it not (`will apply`) and moves nothing. With `--redrive`, once
// the demo has lifted the fault: the last POISON-1 message parked (this test's) is redriven from
// the page, and its job succeeds, its story naming the redrive.
//
//   DEMO_OPERATOR_TOKEN=… NODE_PATH=<dir with playwright-core> node scripts/page-test.cjs http://127.0.0.1:8080 [screenshot.png]
//   DEMO_OPERATOR_TOKEN=… NODE_PATH=… node scripts/page-test.cjs --redrive http://127.0.0.1:8080
"use strict";
const { chromium } = require("playwright-core");

const redriving = process.argv[2] === "--redrive";
const [apiArgument, screenshot] = process.argv.slice(redriving ? 3 : 2);
const api = apiArgument || "http://127.0.0.1:8080";
const executablePath = process.env.CHROMIUM || "/usr/bin/chromium";
const token = process.env.DEMO_OPERATOR_TOKEN;
if (!token) throw new Error("DEMO_OPERATOR_TOKEN is not set: source ops/demo-tokens.env");

async function jobState(jobId) {
  const response = await fetch(`${api}/jobs/${jobId}`);
  if (!response.ok) throw new Error(`GET /jobs/${jobId}: ${response.status}`);
  return (await response.json()).state;
}

// Click a SKU's button; the job id the page reports placing.
async function place(page, sku) {
  const before = await page.locator("#placed").textContent();
  await page.click(`button[data-sku="${sku}"]`);
  await page.waitForFunction((b) => document.querySelector("#placed").textContent !== b, before, { timeout: 5000 });
  const placed = await page.locator("#placed").textContent();
  const match = placed.match(/job ([0-9a-f-]{36})/);
  if (!match) throw new Error(`no job placed for ${sku}: ${placed}`);
  return match[1];
}

// Wait until the page shows `state` for the job, and the API agrees.
async function expectState(page, jobId, state, timeout) {
  const cell = page.locator(`tr[data-job="${jobId}"] [data-state]`);
  await cell.waitFor({ timeout });
  const deadline = Date.now() + timeout;
  for (;;) {
    const shown = await cell.getAttribute("data-state");
    const real = await jobState(jobId);
    if (shown === state && real === state) return;
    if (Date.now() > deadline) throw new Error(`job ${jobId}: page shows ${shown}, API says ${real}, expected ${state}`);
    await page.waitForTimeout(200);
  }
}

// Click the job's row; wait until the page shows exactly the API's story, holding the `expected`
// kinds, the first and the last in their place. (The relay's mark of `published` and inventory's first
// failure are recorded by two services at once: their order is not fixed.)
async function expectStory(page, jobId, expected, timeout) {
  const sorted = (kinds) => [...kinds].sort().join();
  await page.click(`tr[data-job="${jobId}"] td:first-child`);
  const deadline = Date.now() + timeout;
  for (;;) {
    const title = await page.locator("#story-title").textContent();
    const shown = await page.locator("#story li").evaluateAll((items) => items.map((item) => item.dataset.kind));
    const response = await fetch(`${api}/jobs/${jobId}/events`);
    if (!response.ok) throw new Error(`GET /jobs/${jobId}/events: ${response.status}`);
    const { events, traceUrl } = await response.json();
    const real = events.map((event) => event.kind);
    const same = (a, b) => a.length === b.length && a.every((kind, i) => kind === b[i]);
    const ends = shown[0] === expected[0] && shown.at(-1) === expected.at(-1);
    if (title.includes(jobId) && same(shown, real) && sorted(shown) === sorted(expected) && ends) {
      // With a trace viewer named (compose's Jaeger: TRACE_VIEW_URL), the title links to the trace.
      if (traceUrl) {
        const link = await page.locator("#story-title a.trace").getAttribute("href", { timeout: 2000 }).catch(() => null);
        if (link !== traceUrl) throw new Error(`job ${jobId}'s trace link: ${link}, API says ${traceUrl}`);
      }
      return;
    }
    if (Date.now() > deadline) {
      throw new Error(`job ${jobId}'s story: page shows [${shown}], API says [${real}], expected [${expected}]`);
    }
    await page.waitForTimeout(200);
  }
}

async function story(jobId) {
  const response = await fetch(`${api}/jobs/${jobId}/events`);
  if (!response.ok) throw new Error(`GET /jobs/${jobId}/events: ${response.status}`);
  return (await response.json()).events.map((event) => event.kind);
}

// Read the console; the row of a parked message of `job` (the last POISON-1 message parked, if
// `job` is null).
async function parkedRow(page, job) {
  await page.click("#parked-read");
  const row = job
    ? page.locator(`#parked-groups tr[data-job="${job}"]`)
    : page.locator('#parked-groups .group[data-endpoint="inventory.order-placed"]', { hasText: "POISON-1" })
        .locator("tr[data-job]").last();
  await row.waitFor({ timeout: 15000 });
  return row;
}

// A dry run of the row's message: the page says what the API's inbox read says, and nothing moves.
async function dryRun(page, row, verdict) {
  const message = await row.getAttribute("data-message");
  const job = await row.getAttribute("data-job");
  await row.locator('button[data-act="dry run"]').click();
  const said = `#parked-done li[data-message="${message}"][data-action="would redrive"][data-verdict="${verdict}"]`;
  await page.locator(said).waitFor({ timeout: 10000 });
  if ((await jobState(job)) !== "quarantined") throw new Error(`a dry run moved job ${job}`);
  return { message, job };
}

async function redrive(browser) {
  const page = await browser.newPage({ viewport: { width: 1200, height: 900 } });
  await page.goto(`${api}/#token=${token}`);
  const row = await parkedRow(page, null);
  const { message, job } = await dryRun(page, row, "will_apply");
  await row.locator('button[data-act="redrive"]').click();
  await page.locator(`#parked-done li[data-message="${message}"][data-action="redriven"]`).waitFor({ timeout: 10000 });
  const deadline = Date.now() + 30000;
  while ((await jobState(job)) !== "succeeded") {
    if (Date.now() > deadline) throw new Error(`job ${job} did not succeed after its redrive: ${await jobState(job)}`);
    await page.waitForTimeout(300);
  }
  const kinds = await story(job);
  if (!kinds.includes("redriven") || kinds.at(-1) !== "ended") throw new Error(`job ${job}'s story: ${kinds}`);
  console.log(`page: POISON-1 job ${job} redriven from the console, succeeded (story: ${kinds.join(", ")})`);
}

async function main() {
  const browser = await chromium.launch({ executablePath, args: ["--no-sandbox", "--disable-dev-shm-usage"] });
  if (redriving) {
    try {
      return await redrive(browser);
    } finally {
      await browser.close();
    }
  }
  try {
    // Without a token: the status line says 401, and no job is listed.
    const anonymous = await browser.newPage();
    await anonymous.goto(`${api}/`);
    await anonymous.waitForFunction(() => document.querySelector("#status").textContent.includes("401"), null, { timeout: 5000 });
    if ((await anonymous.locator("tr[data-job]").count()) !== 0) throw new Error("the page listed jobs without a token");
    console.log("page: without a token, /overview refused (401) and no job shown");

    const page = await browser.newPage({ viewport: { width: 1200, height: 900 } });
    await page.goto(`${api}/#token=${token}`);

    const flaky = await place(page, "FLAKY-1");
    await expectState(page, flaky, "succeeded", 30000);
    console.log(`page: FLAKY-1 job ${flaky} shown succeeded`);
    // Two failed tries at inventory, and two at billing (compose's MAX_ATTEMPTS=3), then through.
    const retries = ["retry_scheduled", "retry_scheduled"];
    const flakyStory = ["accepted", "published", ...retries, "reserved", ...retries, "invoiced", "ended"];
    await expectStory(page, flaky, flakyStory, 10000);
    console.log(`page: FLAKY-1's story shown: ${flakyStory.join(", ")}`);

    const poison = await place(page, "POISON-1");
    await expectState(page, poison, "quarantined", 30000);
    await page.locator(`#quarantined li[data-job="${poison}"]`).waitFor({ timeout: 5000 });
    // The management API counts queues every few seconds: the depth follows the park.
    const depth = 'tr[data-queue="inventory.order-placed.parking"] td.num';
    const counted = (selector) => Number(document.querySelector(selector)?.textContent) >= 1;
    await page.waitForFunction(counted, depth, { timeout: 15000 }).catch(() => {});
    const parked = await page.locator(depth).textContent();
    if (!(Number(parked) >= 1)) throw new Error(`parking shows ${parked} messages`);
    console.log(`page: POISON-1 job ${poison} shown quarantined, under parking (${parked} parked)`);
    const poisonStory = ["accepted", "published", ...retries, "parked"];
    await expectStory(page, poison, poisonStory, 10000);
    console.log(`page: POISON-1's story shown: ${poisonStory.join(", ")}`);

    // The console: its message, what it carries, and a dry run that reads inventory's inbox.
    const row = await parkedRow(page, poison);
    await row.locator("summary").click();
    const [headers, body] = [await row.locator("pre.headers").textContent(), await row.locator("pre.body").textContent()];
    if (!headers.includes("last-error: ") || !headers.includes("POISON-1")) throw new Error(`headers shown: ${headers}`);
    if (!body.includes(poison) || !body.includes("POISON-1")) throw new Error(`body shown: ${body}`);
    await dryRun(page, row, "will_apply");
    console.log(`page: the console shows POISON-1's parked message, and a dry run says it will apply`);
    if (screenshot) {
      await page.screenshot({ path: screenshot, fullPage: true });
      console.log(`page: screenshot in ${screenshot}`);
    }

    // Can the check fail? Feed the page an /overview where this job never got past `published`.
    const tampered = await browser.newPage();
    await tampered.route("**/overview", async (route) => {
      const response = await route.fetch();
      const overview = await response.json();
      for (const job of overview.jobs) if (job.jobId === flaky) job.state = "published";
      await route.fulfill({ response, json: overview });
    });
    await tampered.goto(`${api}/#token=${token}`);
    let caught = null;
    try {
      await expectState(tampered, flaky, "succeeded", 3000);
    } catch (error) {
      caught = error;
    }
    // The page keeps polling /overview: a request may be in the route when the page closes,
    // which playwright reports as an error of that request, not of the check.
    await tampered.unrouteAll({ behavior: "ignoreErrors" });
    await tampered.close();
    if (!caught) throw new Error("the check passed on a page showing a wrong state");
    console.log(`page: the check fails on a tampered page, as it must (${caught.message})`);
  } finally {
    await browser.close();
  }
}

main().catch((error) => {
  console.error(`page: FAILED: ${error.message}`);
  process.exit(1);
});
