'use strict';
// Opens a notebook in Debian's classic Notebook 6.4 in headless Chromium (driven by playwright-core) and types and
// runs cells as a person would, then checks what appears on the page. When the Notebook server runs with
// --gateway-url, this exercises the whole path browser → Notebook (GatewayClient) → gateway → kernel.
//
// Environment: NOTEBOOK_URL (http://host:port of the Notebook server), NOTEBOOK_TOKEN, NOTEBOOK_PATH (a notebook
// relative to the Notebook's root), SCREENSHOT_PATH (where the final screenshot goes), optional GATEWAY_URL and
// GATEWAY_TOKEN (then the kernel the page uses must be one the gateway runs), optional CHROMIUM (default
// /usr/bin/chromium).
// Run: node --test classic-notebook.test.js
const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const { openHeadlessChromium } = require('./headless-chromium');

const NOTEBOOK_URL = requiredEnv('NOTEBOOK_URL');
const NOTEBOOK_TOKEN = process.env.NOTEBOOK_TOKEN ?? '';
const NOTEBOOK_PATH = requiredEnv('NOTEBOOK_PATH');
const SCREENSHOT_PATH = requiredEnv('SCREENSHOT_PATH');
const GATEWAY_URL = process.env.GATEWAY_URL ?? '';
const GATEWAY_TOKEN = process.env.GATEWAY_TOKEN ?? '';
// Generous: the first kernel start goes Notebook → gateway → confined kernel on a loaded 2-core machine.
const KERNEL_READY_TIMEOUT_MS = 120_000;
const OUTPUT_TIMEOUT_MS = 60_000;

function requiredEnv(name) {
  const value = process.env[name];
  if (!value) throw new Error(`${name} must be set`);
  return value;
}

let browser;
let page;

before(async () => {
  browser = await openHeadlessChromium({ width: 1100, height: 700 });
  page = browser.page;
});

function problems() {
  const seen = browser?.problems ?? [];
  return seen.length ? `\npage problems:\n  ${seen.slice(-10).join('\n  ')}` : '';
}

async function saveScreenshot() {
  fs.mkdirSync(path.dirname(SCREENSHOT_PATH), { recursive: true });
  await page.screenshot({ path: SCREENSHOT_PATH, fullPage: true });
}

// Types code into the selected cell and runs it with Shift+Enter, as a person would.
async function typeAndRun(cellIndex, code) {
  const editor = page.locator('#notebook-container .cell').nth(cellIndex).locator('.CodeMirror');
  await editor.click();
  await page.keyboard.type(code);
  await page.keyboard.press('Shift+Enter');
  return page.locator('#notebook-container .cell').nth(cellIndex);
}

test('the notebook opens and its kernel becomes idle', async () => {
  const url = `${NOTEBOOK_URL}/notebooks/${encodeURI(NOTEBOOK_PATH)}?token=${encodeURIComponent(NOTEBOOK_TOKEN)}`;
  const response = await page.goto(url, { waitUntil: 'domcontentloaded' });
  assert.equal(response.status(), 200, `GET ${NOTEBOOK_PATH} from the Notebook server`);
  try {
    // The kernel indicator turns to the idle icon once the kernel is started and its WebSocket is connected.
    await page.waitForFunction(
      () => window.Jupyter?.notebook?.kernel?.is_connected?.() &&
        document.querySelector('#kernel_indicator_icon.kernel_idle_icon') !== null,
      null, { timeout: KERNEL_READY_TIMEOUT_MS, polling: 250 });
  } catch (error) {
    await saveScreenshot().catch(() => {});
    throw new Error(`kernel never became idle: ${error.message}${problems()}`);
  }
});

test('running print(6*7) and 21*2 shows 42 in both output areas', async () => {
  const printCell = await typeAndRun(0, 'print(6*7)');
  const resultCell = await typeAndRun(1, '21*2');
  try {
    const streamOutput = printCell.locator('.output_subarea.output_stream');
    await streamOutput.waitFor({ timeout: OUTPUT_TIMEOUT_MS });
    assert.equal((await streamOutput.innerText()).trim(), '42');

    const resultOutput = resultCell.locator('.output_subarea.output_result');
    await resultOutput.waitFor({ timeout: OUTPUT_TIMEOUT_MS });
    assert.equal((await resultOutput.innerText()).trim(), '42');
    // In [n] and Out[n] both show the execution count the kernel reported for this run. The Notebook fills In [n]
    // only when the execute_reply arrives, which may come after the result is drawn: wait for the number.
    await resultCell.locator('.input_prompt', { hasText: /\[\s*\d+\s*\]/ }).waitFor({ timeout: OUTPUT_TIMEOUT_MS });
    const inPrompt = (await resultCell.locator('.input_prompt').innerText()).replace(/\s/g, '');
    const outPrompt = (await resultCell.locator('.output_area .prompt.output_prompt').first().innerText()).replace(/\s/g, '');
    const count = /^In\[(\d+)\]:$/.exec(inPrompt)?.[1];
    assert.ok(count && Number(count) >= 2, `the input prompt shows an execution count (got "${inPrompt}")`);
    assert.equal(outPrompt, `Out[${count}]:`);
    assert.equal(await page.locator('#notebook-container .output_error').count(), 0, 'no error output on the page');
  } finally {
    await saveScreenshot();
  }
  assert.ok(fs.statSync(SCREENSHOT_PATH).size > 1000, 'the screenshot was written');
});

test('the stop button interrupts a running cell with KeyboardInterrupt', async () => {
  // The sleep outlasts every wait below many times over: only a working stop button ends the cell in time.
  const sleepingCell = await typeAndRun(2, 'import time\ntime.sleep(600)');
  // Wait until the kernel is really running the cell (the busy indicator), then press stop as a person would.
  await page.locator('#kernel_indicator_icon.kernel_busy_icon').waitFor({ timeout: OUTPUT_TIMEOUT_MS });
  await page.waitForTimeout(500);
  await page.locator('button[data-jupyter-action="jupyter-notebook:interrupt-kernel"]').click();
  try {
    const errorOutput = sleepingCell.locator('.output_subarea.output_error');
    await errorOutput.waitFor({ timeout: OUTPUT_TIMEOUT_MS });
    assert.match(await errorOutput.innerText(), /KeyboardInterrupt/);
    await page.locator('#kernel_indicator_icon.kernel_idle_icon').waitFor({ timeout: OUTPUT_TIMEOUT_MS });
  } finally {
    await saveScreenshot();
  }
});

test('the kernel the page uses is one the gateway runs', async () => {
  // Not a skip: without GATEWAY_URL this check did not run, and that must show (tests/README.md).
  assert.ok(GATEWAY_URL, 'GATEWAY_URL must be set to check the kernel against the gateway');
  const kernelId = await page.evaluate(() => window.Jupyter.notebook.kernel.id);
  assert.match(kernelId, /^[0-9a-f-]{36}$/);
  const response = await fetch(`${GATEWAY_URL}/api/kernels/${kernelId}`,
    { headers: { Authorization: `token ${GATEWAY_TOKEN}` } });
  assert.equal(response.status, 200, `the gateway knows kernel ${kernelId}`);
  const model = await response.json();
  assert.equal(model.id, kernelId);
  assert.ok(model.connections >= 1, `the Notebook holds a WebSocket to the gateway (connections=${model.connections})`);
});
