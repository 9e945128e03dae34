'use strict';
// A person watches an agent's kernel in JupyterLab 4 (`jupyter lab --gateway-url`, Jupyter Server 2.x's
// GatewayClient) in headless Chromium, driven by playwright-core: the agent works through the agent API
// (/agent/v1), the person attaches to the same kernel through JupyterLab, and each sees the other's work.
//
// Jupyter Server 2.x lists through /api/kernels only the gateway kernels it started or attached to (its
// GatewayMappingKernelManager filters the gateway's list), so the person attaches by creating a Lab session with the
// agent's kernel id (POST /api/sessions, as JupyterLab's "use kernel from other session" does), which makes Jupyter
// Server adopt the running kernel instead of starting one ("GatewayKernelManager using existing kernel").
//
// Environment: LAB_URL (http://host:port of jupyter lab), LAB_TOKEN, NOTEBOOK_PATH (an empty notebook relative to
// Lab's root), GATEWAY_URL and GATEWAY_TOKEN (the cellblock gateway Lab points at), SCREENSHOT_PATH, optional
// CHROMIUM (default /usr/bin/chromium).
// Run: node --test jupyterlab.test.js
const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const { openHeadlessChromium } = require('./headless-chromium');

const LAB_URL = requiredEnv('LAB_URL');
const LAB_TOKEN = requiredEnv('LAB_TOKEN');
const NOTEBOOK_PATH = requiredEnv('NOTEBOOK_PATH');
const GATEWAY_URL = requiredEnv('GATEWAY_URL');
const GATEWAY_TOKEN = requiredEnv('GATEWAY_TOKEN');
const SCREENSHOT_PATH = requiredEnv('SCREENSHOT_PATH');
// Generous: Lab's first page load compiles a lot of JavaScript on a loaded 2-core machine. None is a speed check.
const PAGE_READY_TIMEOUT_MS = 120_000;
const OUTPUT_TIMEOUT_MS = 60_000;
const AGENT_SESSION = `watched-by-lab-${process.pid}`;

function requiredEnv(name) {
  const value = process.env[name];
  if (!value) throw new Error(`${name} must be set`);
  return value;
}

let browser;
let page;
let agentKernelId;

async function call(base, token, method, route, body, headers = {}) {
  const response = await fetch(`${base}${route}`, {
    method,
    headers: { Authorization: `token ${token}`, 'Content-Type': 'application/json', ...headers },
    body: body === undefined ? undefined : typeof body === 'string' ? body : JSON.stringify(body),
  });
  const text = await response.text();
  return { status: response.status, body: text ? JSON.parse(text) : null };
}

const agent = (method, route, body, headers) => call(GATEWAY_URL, GATEWAY_TOKEN, method, route, body, headers);
const lab = (method, route, body) => call(LAB_URL, LAB_TOKEN, method, route, body);

async function agentExecute(code) {
  const answer = await agent('POST', `/agent/v1/sessions/${AGENT_SESSION}/execute`, { code });
  assert.equal(answer.status, 200, `agent execute of ${JSON.stringify(code)}: ${JSON.stringify(answer.body)}`);
  return answer.body;
}

function problems() {
  const seen = browser?.problems ?? [];
  return seen.length ? `\npage problems:\n  ${seen.slice(-10).join('\n  ')}` : '';
}

async function saveScreenshot() {
  fs.mkdirSync(path.dirname(SCREENSHOT_PATH), { recursive: true });
  await page.screenshot({ path: SCREENSHOT_PATH, fullPage: true });
}

const cells = () => page.locator('.jp-NotebookPanel .jp-Notebook .jp-Cell');
const indicator = (status) =>
  page.locator(`.jp-NotebookPanel .jp-Notebook-ExecutionIndicator[data-status="${status}"]`);

// Types code into a cell and runs it with Shift+Enter, as a person would; returns that cell's output area once the
// kernel reported the cell's execution count (its execute_reply arrived).
async function typeAndRun(cellIndex, code) {
  const cell = cells().nth(cellIndex);
  await cell.locator('.cm-content').click();
  await page.keyboard.type(code);
  await page.keyboard.press('Shift+Enter');
  await cell.locator('.jp-InputArea-prompt', { hasText: /\[\d+\]/ }).waitFor({ timeout: OUTPUT_TIMEOUT_MS });
  return cell.locator('.jp-OutputArea');
}

before(async () => {
  const created = await agent('POST', '/agent/v1/sessions', { name: AGENT_SESSION });
  assert.equal(created.status, 201, `agent session: ${JSON.stringify(created.body)}`);
  agentKernelId = created.body.kernel_id;
  browser = await openHeadlessChromium({ width: 1280, height: 800 });
  page = browser.page;
});

test('the agent defines x through the agent API', async () => {
  const answer = await agentExecute('x = 6*7');
  assert.equal(answer.status, 'ok', JSON.stringify(answer));
});

test("JupyterLab attaches to the agent's kernel and lists it", async () => {
  const session = await lab('POST', '/api/sessions',
    { path: NOTEBOOK_PATH, name: NOTEBOOK_PATH, type: 'notebook', kernel: { id: agentKernelId } });
  assert.equal(session.status, 201, `Lab session on the agent's kernel: ${JSON.stringify(session.body)}`);
  assert.equal(session.body.kernel.id, agentKernelId, 'Lab adopted the running kernel instead of starting one');
  const kernels = await lab('GET', '/api/kernels');
  assert.deepEqual(kernels.body.map((kernel) => kernel.id), [agentKernelId], "Lab's kernel list");
});

test('the notebook opens on that kernel and print(x) shows the agent\'s 42', async () => {
  const url = `${LAB_URL}/lab/tree/${encodeURI(NOTEBOOK_PATH)}?token=${encodeURIComponent(LAB_TOKEN)}`;
  const response = await page.goto(url, { waitUntil: 'domcontentloaded' });
  assert.equal(response.status(), 200, `GET ${NOTEBOOK_PATH} from jupyter lab`);
  try {
    await indicator('idle').waitFor({ timeout: PAGE_READY_TIMEOUT_MS });
    // The page's kernel is the agent's: Lab's own list (what its Running panel shows) still holds just that one.
    const listed = await page.evaluate(async () => {
      const reply = await fetch('/api/sessions', { credentials: 'same-origin' });
      return (await reply.json()).map((session) => [session.path, session.kernel.id]);
    });
    assert.deepEqual(listed, [[NOTEBOOK_PATH, agentKernelId]], 'the open notebook uses the agent\'s kernel');
    // And Lab's Running panel shows it: the agent's kernel id, with the notebook attached to it (left open for the
    // screenshot).
    await page.locator('.jp-SideBar [data-id="jp-running-sessions"]').click();
    const kernelLabel = page.locator('.jp-RunningSessions-item-label-kernel-id').first();
    await kernelLabel.waitFor({ timeout: OUTPUT_TIMEOUT_MS });
    assert.equal(await kernelLabel.innerText(), `(${agentKernelId.slice(0, 8)})`, 'the Running panel\'s kernel');
    const output = await typeAndRun(0, 'print(x)');
    assert.equal((await output.innerText()).trim(), '42');
  } catch (error) {
    await saveScreenshot().catch(() => {});
    throw new Error(`${error.message}${problems()}`);
  }
});

test("a cell run from JupyterLab is in the agent's next execute", async () => {
  await typeAndRun(1, 'y = x + 1');
  const answer = await agentExecute('y');
  assert.equal(answer.status, 'ok', JSON.stringify(answer));
  assert.deepEqual(answer.result, { 'text/plain': '43' });
});

test("the agent's execute shows busy then idle in JupyterLab without disturbing it", async () => {
  // The agent's cell waits for a file the test writes only once Lab showed busy, so busy cannot be missed.
  const running =
    agentExecute("import os, time\nwhile not os.path.exists('lab-saw-busy'):\n    time.sleep(0.05)\n'released'");
  await indicator('busy').waitFor({ timeout: OUTPUT_TIMEOUT_MS });
  const gate = await agent('PUT', `/agent/v1/sessions/${AGENT_SESSION}/files/lab-saw-busy`, '',
    { 'Content-Type': 'application/octet-stream' });
  assert.equal(gate.status, 201, `PUT lab-saw-busy: ${JSON.stringify(gate.body)}`);
  const answer = await running;
  assert.deepEqual(answer.result, { 'text/plain': "'released'" }, JSON.stringify(answer));
  await indicator('idle').waitFor({ timeout: OUTPUT_TIMEOUT_MS });
  // Not disturbed: no dialog (kernel restarted, died or lost), the same kernel, and the state both wrote is there.
  assert.equal(await page.locator('.jp-Dialog').count(), 0, 'no dialog on the page');
  const output = await typeAndRun(2, 'print(x, y)');
  assert.equal((await output.innerText()).trim(), '42 43');
  const kernels = await lab('GET', '/api/kernels');
  assert.deepEqual(kernels.body.map((kernel) => kernel.id), [agentKernelId], 'still the agent\'s kernel');
  await saveScreenshot();
  assert.ok(fs.statSync(SCREENSHOT_PATH).size > 1000, 'the screenshot was written');
});
