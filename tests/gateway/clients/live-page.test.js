'use strict';
// The live page of an agent session (GET /agent/v1/sessions/{id}/view, share/cellblock/view/) in headless
// Chromium, driven by playwright-core, while an agent works through the agent API (/agent/v1). The browser
// reaches the gateway through a TCP relay started here: it sees every request the browser sends (the proof
// that a hostile output sent none) and can cut the page's connections (the reconnect check).
//
// The approval test starts a second gateway of its own (the installed one, $CELLBLOCK_PREFIX/bin, with a network
// ceiling of `*.test`): the first one, started by the Python test, has no network for any session.
//
// Environment: GATEWAY_URL, GATEWAY_TOKEN, SCREENSHOT_PATH, CELLBLOCK_PREFIX (the approval test), optional
// CHROMIUM, optional LIVE_PAGE_UNSAFE=1 (takes the sandbox and the frame's policy away in the browser, to show the
// hostile-output test fails without them).
// Run: node --test live-page.test.js
const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { spawn } = require('node:child_process');
const fs = require('node:fs');
const http = require('node:http');
const net = require('node:net');
const os = require('node:os');
const path = require('node:path');
const { openHeadlessChromium } = require('./headless-chromium');

const GATEWAY_URL = requiredEnv('GATEWAY_URL');
const GATEWAY_TOKEN = requiredEnv('GATEWAY_TOKEN');
const SCREENSHOT_PATH = requiredEnv('SCREENSHOT_PATH');
const UNSAFE = process.env.LIVE_PAGE_UNSAFE === '1';
const WAIT_MS = 60_000;
const CELLS = Number(process.env.LIVE_PAGE_CELLS || 1000);

function requiredEnv(name) {
  const value = process.env[name];
  if (!value) throw new Error(`${name} must be set`);
  return value;
}

// ------------------------------------------------------------------------------------------- the relay
// Forwards TCP to the gateway; notes the request line of every HTTP request the browser sends; `cut()` drops
// every connection and refuses new ones until `restore()`.
function startRelay(target) {
  const targetUrl = new URL(target);
  const sockets = new Set();
  const requests = [];
  let refusing = false;
  const server = net.createServer((client) => {
    if (refusing) return client.destroy();
    const upstream = net.connect(Number(targetUrl.port), targetUrl.hostname);
    sockets.add(client);
    sockets.add(upstream);
    let pending = '';
    client.on('data', (chunk) => {
      pending = (pending + chunk.toString('latin1')).slice(-65536);
      for (let match; (match = /(GET|POST|PUT|DELETE|HEAD|OPTIONS|PATCH) (\S+) HTTP\/1\.[01]\r\n/.exec(pending));) {
        requests.push(`${match[1]} ${match[2]}`);
        pending = pending.slice(match.index + match[0].length);
      }
    });
    client.pipe(upstream);
    upstream.pipe(client);
    const drop = () => { client.destroy(); upstream.destroy(); sockets.delete(client); sockets.delete(upstream); };
    client.on('error', drop);
    upstream.on('error', drop);
    client.on('close', drop);
    upstream.on('close', drop);
  });
  return new Promise((resolve) => server.listen(0, '127.0.0.1', () => resolve({
    url: `http://127.0.0.1:${server.address().port}`,
    requests,
    cut() { refusing = true; for (const socket of sockets) socket.destroy(); sockets.clear(); },
    restore() { refusing = false; },
    close() { for (const socket of sockets) socket.destroy(); server.close(); },
  })));
}

// --------------------------------------------------------------------------------------- the agent API
// `gateway` (optional, last): { url, token } of another gateway than GATEWAY_URL's.
async function api(method, path, body, gateway = { url: GATEWAY_URL, token: GATEWAY_TOKEN }) {
  const response = await fetch(`${gateway.url}${path}`, {
    method,
    headers: { Authorization: `token ${gateway.token}`, 'Content-Type': 'application/json' },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await response.text();
  assert.ok(response.ok, `${method} ${path}: ${response.status} ${text}`);
  return JSON.parse(text);
}

// Runs `code` with the NDJSON stream; `onEvent(event, receivedAtMs)` sees each event as it arrives.
function executeStreaming(session, code, onEvent, gateway = { url: GATEWAY_URL, token: GATEWAY_TOKEN }) {
  return new Promise((resolve, reject) => {
    const url = new URL(`${gateway.url}/agent/v1/sessions/${session}/execute`);
    const request = http.request(url, {
      method: 'POST',
      headers: { Authorization: `token ${gateway.token}`, 'Content-Type': 'application/json',
        Accept: 'application/x-ndjson' },
    }, (response) => {
      let buffer = '';
      let last = null;
      response.setEncoding('utf8');
      response.on('data', (chunk) => {
        const now = Date.now();
        buffer += chunk;
        let newline;
        while ((newline = buffer.indexOf('\n')) >= 0) {
          const line = buffer.slice(0, newline).trim();
          buffer = buffer.slice(newline + 1);
          if (!line) continue;
          last = JSON.parse(line);
          if (onEvent) onEvent(last, now);
        }
      });
      response.on('end', () => resolve(last));
      response.on('error', reject);
    });
    request.on('error', reject);
    request.end(JSON.stringify({ code }));
  });
}

// ------------------------------------------------------------------------------------ a second gateway
// The installed gateway with `extraArguments`, on a free port with a token of its own, until `stop()`.
async function startGateway(extraArguments) {
  const prefix = requiredEnv('CELLBLOCK_PREFIX');
  const port = await new Promise((resolve) => {
    const probe = net.createServer().listen(0, '127.0.0.1', () => {
      const { port: free } = probe.address();
      probe.close(() => resolve(free));
    });
  });
  const token = require('node:crypto').randomBytes(16).toString('hex');
  const stateDir = fs.mkdtempSync(path.join(os.tmpdir(), 'cellblock-live-page-gateway-'));
  const child = spawn(path.join(prefix, 'bin', 'cellblock-gateway'),
    ['--ip', '127.0.0.1', '--port', String(port), '--token', token, '--state-dir', path.join(stateDir, 'state'),
      '--shutdown-kernels-on-exit', ...extraArguments],
    { env: { JUPYTER_PATH: path.join(prefix, 'share', 'jupyter'), ...process.env }, stdio: ['ignore', 'pipe', 'pipe'] });
  let log = '';
  const exited = new Promise((resolve) => child.on('exit', resolve));
  await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`the second gateway did not start:\n${log}`)), WAIT_MS);
    const onOutput = (chunk) => {
      log += chunk;
      if (log.includes(`is available at http://127.0.0.1:${port}`)) { clearTimeout(timer); resolve(); }
    };
    child.stdout.on('data', onOutput);
    child.stderr.on('data', onOutput);
    child.on('exit', (code) => { clearTimeout(timer); reject(new Error(`the second gateway exited (${code}):\n${log}`)); });
  });
  return {
    url: `http://127.0.0.1:${port}`,
    token,
    log: () => log,
    async stop() {
      if (child.exitCode === null) child.kill('SIGTERM');
      await exited;
      fs.rmSync(stateDir, { recursive: true, force: true });
    },
  };
}

let browser;
let page;
let relay;
let session;
const cleanups = [];  // what a test started beyond the above (a second gateway, a second browser)

before(async () => {
  relay = await startRelay(GATEWAY_URL);
  session = (await api('POST', '/agent/v1/sessions', {})).id;
  browser = await openHeadlessChromium({ width: 1100, height: 900 });
  page = browser.page;
  if (UNSAFE) {
    // Only to show the hostile-output test red: no sandbox attribute, no policy in or on the frame.
    await page.route('**/view/static/page.js', async (route) => {
      const response = await route.fetch();
      const body = (await response.text())
        .replace("iframe.setAttribute('sandbox', 'allow-scripts');", '')
        .replace('<meta http-equiv="Content-Security-Policy" content="${FRAME_POLICY}">', '');
      await route.fulfill({ response, body });
    });
    await page.route('**/view/static/frame.html', async (route) => {
      const response = await route.fetch();
      const headers = { ...response.headers() };
      delete headers['content-security-policy'];
      await route.fulfill({ response, headers });
    });
  }
  // Every message the page receives from a frame, for the hostile-output test (installed before the page's own
  // script; Playwright's init scripts are not subject to the page's policy).
  await page.addInitScript(() => {
    window.hostileReports = [];
    addEventListener('message', (event) => {
      if (event.data && event.data.hostile) window.hostileReports.push(event.data);
    });
  });
});

after(async () => {
  for (const cleanup of cleanups.reverse()) await cleanup().catch((error) => console.error(error));
  if (browser) await browser.close();
  if (relay) relay.close();
});

// A page's errors of its own: not what the policy blocked of the hostile outputs, nor a cut connection.
function ownProblems(problems) {
  return problems.filter((problem) =>
    !/Content Security Policy|net::ERR_|Failed to load resource|ERR_CONNECTION|EventSource/.test(problem));
}

function failOnProblems() {
  assert.deepEqual(ownProblems(browser.problems), [], 'the page had no errors of its own');
}

// Resolves with Date.now() at the moment the page's DOM first has `marker` in a cell's output (a
// MutationObserver in the page notes it); the cell's code, shown when the cell starts, holds the marker too
// and does not count.
async function watchFor(marker) {
  await page.evaluate((text) => {
    window.seenAt = window.seenAt || {};
    const observer = new MutationObserver(() => {
      const outputs = document.querySelectorAll('#cells section.cell .stream');
      if ([...outputs].some((output) => output.textContent.includes(text))) {
        window.seenAt[text] = Date.now();
        observer.disconnect();
      }
    });
    observer.observe(document.getElementById('cells'), { childList: true, subtree: true, characterData: true });
  }, marker);
  return async () => {
    const handle = await page.waitForFunction((text) => window.seenAt && window.seenAt[text], marker,
      { timeout: WAIT_MS });
    return handle.jsonValue();
  };
}

test('the token travels once: a 303 takes it out of the address, the cookie is HttpOnly', async () => {
  await page.goto(`${relay.url}/agent/v1/sessions/${session}/view?token=${GATEWAY_TOKEN}`);
  assert.equal(page.url(), `${relay.url}/agent/v1/sessions/${session}/view`);
  assert.ok(!page.url().includes(GATEWAY_TOKEN));
  await page.waitForFunction(() => document.getElementById('connection').textContent === 'live', null,
    { timeout: WAIT_MS });
  assert.equal(await page.evaluate(() => document.cookie), '', 'the page script cannot read the cookie');
  const cookies = await page.context().cookies();
  const view = cookies.find((cookie) => cookie.name === 'cellblock_view');
  assert.ok(view && view.httpOnly && view.sameSite === 'Strict' && view.path === `/agent/v1/sessions/${session}`);
  assert.notEqual(view.value, GATEWAY_TOKEN);
  assert.ok(relay.requests.every((line) => !line.includes(GATEWAY_TOKEN) || line.includes('view?token=')),
    'the token went over the wire once, in the first request');
});

test('a print shows in the page within 1 s of its stdout event', async () => {
  const latencies = [];
  for (let round = 0; round < 5; round++) {
    const marker = `printed-live-${round}-${process.pid}`;
    const seen = await watchFor(marker);
    let stdoutAt = null;
    const answer = await executeStreaming(session,
      `import time\nprint(${JSON.stringify(marker)}, flush=True)\ntime.sleep(0.3)`,
      (event, at) => { if (event.type === 'stdout' && event.text.includes(marker) && stdoutAt === null) stdoutAt = at; });
    assert.equal(answer.status, 'ok', JSON.stringify(answer));
    assert.ok(stdoutAt !== null, 'the execute streamed its stdout');
    latencies.push((await seen()) - stdoutAt);
  }
  latencies.sort((a, b) => a - b);
  console.log(`[live-page] stdout event -> page DOM: median ${latencies[2]} ms, max ${latencies[4]} ms ` +
    `(${latencies.join(', ')})`);
  assert.ok(latencies[4] <= 1000, `within 1 s: ${latencies}`);
  const cell = page.locator('section.cell', { hasText: `printed-live-4-${process.pid}` });
  await cell.locator('.outcome', { hasText: 'ok' }).waitFor({ timeout: WAIT_MS });
  assert.match(await cell.locator('.duration').textContent(), /\d+(\.\d+)? m?s/);
});

test('a matplotlib plot renders as an image', async () => {
  const answer = await executeStreaming(session,
    "import matplotlib\nmatplotlib.use('module://matplotlib_inline.backend_inline')\n" +
    "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2, 5], marker='o')\nplt.title('live page')\nplt.show()");
  assert.equal(answer.status, 'ok', JSON.stringify(answer));
  const image = page.locator('section.cell .output-img img[src^="data:image/png;base64,"]').last();
  await image.waitFor({ timeout: WAIT_MS });
  await page.waitForFunction((img) => img.complete && img.naturalWidth > 100, await image.elementHandle(),
    { timeout: WAIT_MS });
  await image.scrollIntoViewIfNeeded();
  await page.screenshot({ path: SCREENSHOT_PATH });
});

test('an error shows its traceback in colour, ANSI output too', async () => {
  await executeStreaming(session,
    "print('\\x1b[31mred text\\x1b[0m plain')\ndef ratio(a, b):\n    return a / b\nratio(1, 0)");
  const cell = page.locator('section.cell.error', { hasText: 'ratio(1, 0)' });
  await cell.locator('.outcome', { hasText: 'error' }).waitFor({ timeout: WAIT_MS });
  const exception = cell.locator('.traceback .tb-exc, .traceback [class*="ansi-fg"]').last();
  await exception.waitFor({ timeout: WAIT_MS });
  assert.match(await cell.locator('.traceback').textContent(), /ZeroDivisionError/);
  const colour = await exception.evaluate((node) => getComputedStyle(node).color);
  assert.notEqual(colour, await page.evaluate(() => getComputedStyle(document.body).color), 'coloured');
  const red = cell.locator('.stream .ansi-fg-1');
  assert.equal(await red.textContent(), 'red text');
  assert.doesNotMatch(await cell.locator('.stream').first().textContent(), /\x1b|\[31m/);
});

test('hostile HTML and img onerror in an output read nothing and send nothing', async () => {
  const hostileHtml = [
    '<p id="hostile">hostile output</p>',
    '<script>',
    'const report = (what, value) => parent.postMessage({hostile: what, value: String(value).slice(0, 300)}, "*");',
    "fetch('/agent/v1/sessions?hostile=fetch').then(r => r.text()).then(t => report('fetch', t), e => report('fetch-failed', e));",
    `fetch('/agent/v1/sessions/${session}/events?hostile=events', {headers: {Accept: 'text/event-stream'}})`,
    "  .then(r => report('events', r.status), e => report('events-failed', e));",
    "try { report('parent-dom', parent.document.body.textContent) } catch (e) { report('parent-dom-failed', e) }",
    "try { report('cookie', document.cookie) } catch (e) { report('cookie-failed', e) }",
    '</script>',
    '<img src="x?hostile=img" onerror="fetch(\'/agent/v1/sessions?hostile=onerror\').then(r => r.text())' +
      '.then(t => parent.postMessage({hostile: \'onerror\', value: t}, \'*\'), e => parent.postMessage(' +
      '{hostile: \'onerror-failed\', value: String(e)}, \'*\'))">',
  ].join('\n');
  const answer = await executeStreaming(session,
    `from IPython.display import HTML, display\ndisplay(HTML(${JSON.stringify(hostileHtml)}))`);
  assert.equal(answer.status, 'ok', JSON.stringify(answer));
  const frame = page.locator('section.cell .frame-holder iframe').last();
  await frame.waitFor({ timeout: WAIT_MS });
  if (!UNSAFE) assert.equal(await frame.getAttribute('sandbox'), 'allow-scripts');
  // Each attempt reports once, as a success or a failure: wait for all five.
  await page.waitForFunction(() => new Set(window.hostileReports.map((r) => r.hostile.replace('-failed', ''))).size >= 5,
    null, { timeout: WAIT_MS });
  const reports = await page.evaluate(() => window.hostileReports);
  const succeeded = reports.filter((report) => !report.hostile.endsWith('-failed'));
  assert.deepEqual(succeeded, [], `the output read something: ${JSON.stringify(succeeded)}`);
  const sent = relay.requests.filter((line) => line.includes('hostile='));
  assert.deepEqual(sent, [], 'no request of the output reached the gateway');
  // The frame did render the output (it is contained, not just broken).
  const inner = page.frameLocator('section.cell .frame-holder iframe').last();
  assert.equal(await inner.locator('#hostile').textContent(), 'hostile output');
});

// JavaScript that tries, from inside an output, to read the gateway (a fetch of the session list, the session's
// events with the page's cookie, an image), the page's DOM and the cookie; each attempt but the image posts one
// report `${prefix}-what` or `${prefix}-what-failed` to the page. No `<` and no `&`: it also runs in an SVG <script>.
function hostileProbe(prefix) {
  return [
    `const report = (what, value) => parent.postMessage({hostile: '${prefix}-' + what, value: String(value).slice(0, 300)}, '*');`,
    `fetch('/agent/v1/sessions?hostile=${prefix}-fetch').then(r => r.text()).then(t => report('fetch', t), e => report('fetch-failed', e));`,
    `fetch('/agent/v1/sessions/${session}/events?hostile=${prefix}-events', {headers: {Accept: 'text/event-stream'}})`,
    "  .then(r => report('events', r.status), e => report('events-failed', e));",
    "try { report('parent-dom', parent.document.body.textContent) } catch (e) { report('parent-dom-failed', e) }",
    "try { report('cookie', document.cookie) } catch (e) { report('cookie-failed', e) }",
    `new Image().src = '/agent/v1/sessions?hostile=${prefix}-image';`,
  ].join('\n');
}

test('hostile SVG (onload, script) and JavaScript outputs read nothing and send nothing; a DataFrame shows as a table', async () => {
  const marker = `hostile-svg-js-${process.pid}`;
  const svg = [
    '<svg xmlns="http://www.w3.org/2000/svg" width="240" height="40" onload="' +
      "fetch('/agent/v1/sessions?hostile=svg-onload').then(r => r.text()).then(t => parent.postMessage(" +
      "{hostile: 'svg-onload', value: t.slice(0, 300)}, '*'), e => parent.postMessage(" +
      "{hostile: 'svg-onload-failed', value: String(e)}, '*'))\">",
    '<text id="hostile-svg" x="4" y="24">hostile svg</text>',
    `<script>${hostileProbe('svg')}</script>`,
    '</svg>',
  ].join('\n');
  const javascript = hostileProbe('js');
  const answer = await executeStreaming(session, [
    `# ${marker}`,
    'from IPython.display import display',
    'import pandas as pd',
    `display({'image/svg+xml': ${JSON.stringify(svg)}}, raw=True)`,
    `display({'application/javascript': ${JSON.stringify(javascript)}}, raw=True)`,
    "display(pd.DataFrame({'city': ['Oslo', 'Lima', 'Pune'], 'rain_mm': [763, 13, 722]}))",
  ].join('\n'));
  assert.equal(answer.status, 'ok', JSON.stringify(answer));
  const cell = page.locator('section.cell', { hasText: marker });
  const frames = cell.locator('.frame-holder iframe');
  await frames.nth(2).waitFor({ state: 'attached', timeout: WAIT_MS });
  assert.equal(await frames.count(), 3, 'the SVG, the JavaScript and the table, each in a frame of its own');
  if (!UNSAFE) {
    for (let index = 0; index < 3; index++) assert.equal(await frames.nth(index).getAttribute('sandbox'), 'allow-scripts');
  }
  // Each attempt reports once, as a success or a failure: wait for all nine.
  const expected = ['svg-onload', ...['svg', 'js'].flatMap((prefix) =>
    ['fetch', 'events', 'parent-dom', 'cookie'].map((what) => `${prefix}-${what}`))];
  await page.waitForFunction((names) => {
    const seen = new Set(window.hostileReports.map((r) => r.hostile.replace(/-failed$/, '')));
    return names.every((name) => seen.has(name));
  }, expected, { timeout: WAIT_MS });
  const reports = await page.evaluate(() => window.hostileReports.filter((r) => /^(svg|js)-/.test(r.hostile)));
  const succeeded = reports.filter((report) => !report.hostile.endsWith('-failed'));
  assert.deepEqual(succeeded, [], `the output read something: ${JSON.stringify(succeeded)}`);
  const sent = relay.requests.filter((line) => /hostile=(svg|js)-/.test(line));
  assert.deepEqual(sent, [], 'no request of the output reached the gateway');
  // The SVG did render (it is contained, not just broken).
  assert.equal(await frames.nth(0).contentFrame().locator('#hostile-svg').textContent(), 'hostile svg');

  // The DataFrame: a table whose rows a reader sees, inside a frame grown to hold them.
  const tableFrame = frames.nth(2);
  await tableFrame.scrollIntoViewIfNeeded();
  const table = tableFrame.contentFrame().locator('table.dataframe');
  await table.waitFor({ timeout: WAIT_MS });
  const rows = table.locator('tbody tr');
  assert.equal(await rows.count(), 3);
  assert.deepEqual(await rows.evaluateAll((trs) => trs.map((tr) => [...tr.children].map((td) => td.textContent.trim()))),
    [['0', 'Oslo', '763'], ['1', 'Lima', '13'], ['2', 'Pune', '722']]);
  const deadline = Date.now() + WAIT_MS;
  for (;;) {
    const outer = await tableFrame.boundingBox();
    const boxes = await Promise.all([...Array(3).keys()].map((index) => rows.nth(index).boundingBox()));
    const inside = outer && boxes.every((box) => box && box.height > 0 && box.y >= outer.y &&
      box.y + box.height <= outer.y + outer.height + 0.5 && box.x + box.width <= outer.x + outer.width + 0.5);
    if (inside) break;
    assert.ok(Date.now() < deadline, `the table's rows lie inside its frame: ${JSON.stringify({ outer, boxes })}`);
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
  for (let index = 0; index < 3; index++) assert.ok(await rows.nth(index).isVisible(), `row ${index} is visible`);
  failOnProblems();
});

test('a Markdown output renders as Markdown, and HTML inside it is as contained as an HTML output', async () => {
  const marker = `markdown-${process.pid}`;
  const markdown = `# Rainfall ${marker}\n\nThe **wettest** city is *Oslo*.\n\n- one\n- two\n\n` +
    `<script>${hostileProbe('md')}</script>\n`;
  const answer = await executeStreaming(session,
    `from IPython.display import display\ndisplay({'text/markdown': ${JSON.stringify(markdown)}}, raw=True)`);
  assert.equal(answer.status, 'ok', JSON.stringify(answer));
  const frame = page.locator('section.cell .frame-holder iframe').last();
  await frame.waitFor({ state: 'attached', timeout: WAIT_MS });
  await frame.scrollIntoViewIfNeeded();
  const inside = frame.contentFrame();
  await inside.locator('h1', { hasText: marker }).waitFor({ timeout: WAIT_MS });
  assert.equal(await inside.locator('strong').textContent(), 'wettest');
  assert.equal(await inside.locator('em').textContent(), 'Oslo');
  assert.equal(await inside.locator('li').count(), 2);
  if (!UNSAFE) assert.equal(await frame.getAttribute('sandbox'), 'allow-scripts');
  const expected = ['fetch', 'events', 'parent-dom', 'cookie'].map((what) => `md-${what}`);
  await page.waitForFunction((names) => {
    const seen = new Set(window.hostileReports.map((r) => r.hostile.replace(/-failed$/, '')));
    return names.every((name) => seen.has(name));
  }, expected, { timeout: WAIT_MS });
  const succeeded = await page.evaluate(() =>
    window.hostileReports.filter((r) => r.hostile.startsWith('md-') && !r.hostile.endsWith('-failed')));
  assert.deepEqual(succeeded, [], `the Markdown's script read something: ${JSON.stringify(succeeded)}`);
  assert.deepEqual(relay.requests.filter((line) => /hostile=md-/.test(line)), [], 'no request reached the gateway');
  failOnProblems();
});

test('cells run while the page is cut off appear once each when it reconnects', async () => {
  const markers = [0, 1, 2].map((i) => `while-offline-${i}-${process.pid}`);
  relay.cut();
  await page.waitForFunction(() => document.getElementById('connection').textContent !== 'live', null,
    { timeout: WAIT_MS });
  for (const marker of markers) {
    const answer = await executeStreaming(session, `print(${JSON.stringify(marker)})`);
    assert.equal(answer.status, 'ok');
  }
  const before = await page.evaluate(() => document.getElementById('cells').textContent);
  assert.ok(markers.every((marker) => !before.includes(marker)), 'nothing arrived while cut off');
  relay.restore();
  await page.waitForFunction((texts) => texts.every((text) => document.getElementById('cells').textContent.includes(text)),
    markers, { timeout: WAIT_MS });
  await page.waitForFunction(() => document.getElementById('connection').textContent === 'live', null,
    { timeout: WAIT_MS });
  for (const marker of markers) {
    assert.equal(await page.locator('section.cell .code', { hasText: marker }).count(), 1, `${marker}: one cell`);
    assert.equal(await page.locator('section.cell .stream', { hasText: marker }).count(), 1, `${marker}: once`);
  }
  const numbers = await page.evaluate(() => [...document.querySelectorAll('section.cell')].map((c) => Number(c.dataset.cell)));
  assert.deepEqual(numbers, [...numbers].sort((a, b) => a - b), 'cells in order');
  assert.equal(new Set(numbers).size, numbers.length, 'no cell twice');
  failOnProblems();
});

test('a cell printing 10 MB keeps the page responsive and ends with its head, tail and saved file', async () => {
  const head = `ten-mb-head-${process.pid}`;
  const tail = `ten-mb-tail-${process.pid}`;
  await page.waitForFunction(() => document.getElementById('connection').textContent === 'live', null,
    { timeout: WAIT_MS });
  const tailSeen = await watchFor(tail);
  // The gaps between the page's animation frames while the cell runs: a main thread busy with the output (a
  // long task, a layout of megabytes) shows as a long gap, which is what a reader feels as a frozen page.
  await page.evaluate(() => {
    window.frameGaps = [];
    window.probing = true;
    let last = performance.now();
    const tick = (now) => {
      window.frameGaps.push(now - last);
      last = now;
      if (window.probing) requestAnimationFrame(tick);
    };
    requestAnimationFrame(tick);
  });
  const started = Date.now();
  let endAt = null;
  // 10,000 lines of 1,024 bytes between the two markers.
  const answer = await executeStreaming(session,
    `line = 'x' * 1017\nprint(${JSON.stringify(head)})\n` +
    `for i in range(10_000):\n    print(f'{i:05d} {line}')\nprint(${JSON.stringify(tail)})`,
    (event, at) => { endAt = at; });
  assert.equal(answer.status, 'ok', JSON.stringify({ ...answer, stdout: answer.stdout.slice(0, 300) }));
  const whole = Number((/ of (\d+) bytes omitted here/.exec(answer.stdout) || [])[1]);
  assert.ok(whole >= 10_240_000, `the cell printed 10 MB: ${whole} bytes`);
  assert.ok(answer.saved && answer.saved.stdout, `the answer names the saved file: ${JSON.stringify(answer.saved)}`);
  // The page shows the tail only from the end event: the live relay stopped long before it.
  const shownAt = await tailSeen();
  // Two frames more: a frame's gap is noted in the frame after it, and the end's rendering is part of the run.
  const gaps = await page.evaluate(() => new Promise((resolve) => requestAnimationFrame(() =>
    requestAnimationFrame(() => { window.probing = false; resolve(window.frameGaps); }))));
  gaps.sort((a, b) => a - b);
  const median = Math.round(gaps[Math.floor(gaps.length / 2)]);
  const max = Math.round(gaps[gaps.length - 1]);
  console.log(`[live-page] 10 MB cell: frame gaps median ${median} ms, max ${max} ms over ${gaps.length} frames; ` +
    `execute ${endAt - started} ms, end -> page DOM ${shownAt - endAt} ms`);
  assert.ok(gaps.length >= (shownAt - started) / 500, `the page drew frames all along: ${gaps.length}`);
  assert.ok(max <= 500, `no frame gap over 500 ms: max ${max} ms, median ${median} ms`);
  // What a reader sees: the head and the tail, the gateway's note of what was left out and where the whole
  // is, the live relay's notice, the saved file's name; not 10 MB in the page.
  const cell = page.locator('section.cell', { has: page.locator('.code', { hasText: head }) });
  await cell.locator('.outcome', { hasText: 'ok' }).waitFor({ timeout: WAIT_MS });
  const shown = await cell.locator('.stream').allTextContents();
  assert.equal(shown.length, 1, 'one stdout block: the live part gave way to the head and tail');
  assert.ok(shown[0].startsWith(`${head}\n00000 `), `the head first: ${shown[0].slice(0, 80)}`);
  assert.ok(shown[0].trimEnd().endsWith(`09999 ${'x'.repeat(1017)}\n${tail}`), `the tail last: ${shown[0].slice(-80)}`);
  assert.match(shown[0], new RegExp(`\\[cellblock: \\d+ of \\d+ bytes omitted here; the full text is in the ` +
    `workspace file ${answer.saved.stdout.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')}\\]`));
  assert.ok(shown[0].length <= 100_000, `the page holds the head and tail only: ${shown[0].length} characters`);
  assert.match(await cell.locator('.notice').allInnerTexts().then((texts) => texts.join('\n')),
    /further stdout is not relayed live .* the cell's end shows its head and tail/);
  assert.equal(await cell.locator('.saved').textContent(),
    `whole output saved in the workspace (stdout: ${answer.saved.stdout})`);
  failOnProblems();
});

test(`a session of ${CELLS} cells opens within 1 s`, async () => {
  const big = (await api('POST', '/agent/v1/sessions', {})).id;
  let next = 0;
  const worker = async () => {
    while (next < CELLS) {
      const index = next++;
      await api('POST', `/agent/v1/sessions/${big}/execute`, { code: `print('cell ${index}')\n${index}` });
    }
  };
  await Promise.all(Array.from({ length: 4 }, worker));
  await page.goto(`${relay.url}/agent/v1/sessions/${big}/view?token=${GATEWAY_TOKEN}`);
  const started = await page.evaluate(() => performance.timeOrigin);
  await page.waitForFunction((count) => document.querySelectorAll('section.cell.ok').length >= count, CELLS,
    { timeout: WAIT_MS, polling: 'raf' });
  const done = await page.evaluate(() => performance.timeOrigin + performance.now());
  const openMs = Math.round(done - started);
  console.log(`[live-page] ${CELLS} cells: page open to every cell rendered ${openMs} ms`);
  assert.ok(openMs <= 1000, `opened in ${openMs} ms`);
  failOnProblems();
});

test('the list page shows each session live and its link opens the session page', async () => {
  await page.goto(`${relay.url}/agent/v1/view?token=${GATEWAY_TOKEN}`);
  assert.equal(page.url(), `${relay.url}/agent/v1/view`);
  const row = page.locator('#sessions tbody tr', { has: page.locator(`a[href="view/open/${session}"]`) });
  await row.waitFor({ timeout: WAIT_MS });
  assert.equal(await row.locator('td').nth(1).textContent(), 'idle');
  // A running cell shows as running on the next poll, and idle again after.
  const running = executeStreaming(session, "import time\nprint('list-page', flush=True)\ntime.sleep(1.5)");
  await row.locator('td', { hasText: 'running' }).waitFor({ timeout: WAIT_MS });
  await running;
  await row.locator('td', { hasText: 'idle' }).waitFor({ timeout: WAIT_MS });
  await row.locator('a').click();
  await page.waitForURL(`${relay.url}/agent/v1/sessions/${session}/view`, { timeout: WAIT_MS });
  await page.locator('section.cell .stream', { hasText: 'list-page' }).waitFor({ timeout: WAIT_MS });
  assert.equal(await page.evaluate(() => document.cookie), '');
  failOnProblems();
});

// Resolves once the page's scroll position held still for five animation frames (a wheel may scroll smoothly).
function scrollSettled() {
  return page.evaluate(() => new Promise((resolve) => {
    let last = window.scrollY;
    let still = 0;
    const tick = () => {
      still = window.scrollY === last ? still + 1 : 0;
      last = window.scrollY;
      if (still >= 5) resolve(); else requestAnimationFrame(tick);
    };
    requestAnimationFrame(tick);
  }));
}

// The session's page in `page`, live (a test run alone by name starts here too).
async function openSessionPage() {
  await page.goto(`${relay.url}/agent/v1/sessions/${session}/view?token=${GATEWAY_TOKEN}`);
  await page.waitForFunction(() => document.getElementById('connection').textContent === 'live', null,
    { timeout: WAIT_MS });
}

test('a cell that kills its Python worker shows the state-lost notice, and the next cell runs', async () => {
  await openSessionPage();
  const dying = `worker-exits-${process.pid}`;
  const answer = await executeStreaming(session, `# ${dying}\nimport os\nkept = 1\nos._exit(3)`);
  assert.equal(answer.status, 'error', JSON.stringify(answer));
  assert.equal(answer.state_lost, true, JSON.stringify(answer));
  const cell = page.locator('section.cell', { has: page.locator('.code', { hasText: dying }) });
  await cell.locator('.outcome', { hasText: 'error' }).waitFor({ timeout: WAIT_MS });
  const notice = cell.locator('.notice.state-lost');
  await notice.waitFor({ timeout: WAIT_MS });
  assert.equal(await notice.textContent(), answer.notice);
  assert.match(await notice.textContent(), /variables and imports from earlier executes are gone/);
  assert.match(await cell.locator('.traceback').textContent(), /WorkerDied: exited with status 3/);
  // Shown in red, apart from the other notices.
  assert.equal(await notice.evaluate((node) => getComputedStyle(node).color), 'rgb(207, 34, 46)');
  // The next cell runs on a fresh worker: its output and outcome show, `kept` is gone.
  const after = `after-the-worker-${process.pid}`;
  const next = await executeStreaming(session, `print(${JSON.stringify(after)}, 'kept' in globals())`);
  assert.equal(next.status, 'ok', JSON.stringify(next));
  const nextCell = page.locator('section.cell', { has: page.locator('.code', { hasText: after }) });
  await nextCell.locator('.outcome', { hasText: 'ok' }).waitFor({ timeout: WAIT_MS });
  assert.equal(await nextCell.locator('.stream.stdout').textContent(), `${after} False\n`);
  failOnProblems();
});

test('the page follows the newest cell until the reader scrolls up, and the follow button brings it back', async () => {
  await openSessionPage();
  const atBottom = () => window.scrollY + window.innerHeight >= document.documentElement.scrollHeight - 2;
  const follow = page.locator('#follow');
  // Cells taller than the window: each new one takes the page to the bottom.
  for (let round = 0; round < 3; round++) {
    const marker = `follow-${round}-${process.pid}`;
    const seen = await watchFor(`${marker} line 119`);
    await executeStreaming(session, `for i in range(120):\n    print(${JSON.stringify(marker)}, 'line', i)`);
    await seen();
    await page.waitForFunction(atBottom, null, { timeout: WAIT_MS });
    assert.ok(await follow.isHidden(), 'no follow button while following');
  }
  assert.ok(await page.evaluate(() => document.documentElement.scrollHeight > 3 * window.innerHeight));
  // The reader scrolls up with the wheel: the button shows.
  const bottomY = await page.evaluate(() => window.scrollY);
  await page.mouse.move(500, 500);
  await page.mouse.wheel(0, -1500);
  await page.waitForFunction((y) => window.scrollY <= y - 1000, bottomY, { timeout: WAIT_MS });
  await follow.waitFor({ state: 'visible', timeout: WAIT_MS });
  await scrollSettled();
  assert.equal(await follow.textContent(), 'follow the newest cell');
  const readingY = await page.evaluate(() => window.scrollY);
  const reading = await page.evaluate(() => document.documentElement.scrollHeight);
  // A new cell's output arrives; the reader stays where they are, the new output below the window.
  const late = `follow-late-${process.pid}`;
  const lateSeen = await watchFor(`${late} line 119`);
  await executeStreaming(session, `for i in range(120):\n    print(${JSON.stringify(late)}, 'line', i)`);
  await lateSeen();
  await page.locator('section.cell', { has: page.locator('.code', { hasText: late }) })
    .locator('.outcome', { hasText: 'ok' }).waitFor({ timeout: WAIT_MS });
  // A frame more: the batch that brought the output has scrolled (or not) by then.
  await page.evaluate(() => new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve))));
  assert.ok(await page.evaluate(() => document.documentElement.scrollHeight) > reading, 'the page grew');
  assert.equal(await page.evaluate(() => window.scrollY), readingY, 'the new output did not move the page');
  const lateCell = page.locator('section.cell', { has: page.locator('.code', { hasText: late }) });
  assert.ok(await lateCell.evaluate((node) => node.getBoundingClientRect().top > window.innerHeight),
    'the new cell is below the window');
  assert.ok(await follow.isVisible(), 'the follow button still shows');
  console.log(`[live-page] follow: the reader ${bottomY - readingY} px above the bottom stayed at ${readingY} px ` +
    `while the page grew by ${await page.evaluate(() => document.documentElement.scrollHeight) - reading} px`);
  // The button: back to the bottom, the newest output in view, following again.
  await follow.click();
  await page.waitForFunction(atBottom, null, { timeout: WAIT_MS });
  await follow.waitFor({ state: 'hidden', timeout: WAIT_MS });
  assert.ok(await lateCell.locator('.stream').evaluate((node) => {
    const box = node.getBoundingClientRect();
    return box.bottom > 0 && box.bottom <= window.innerHeight;
  }), 'the end of the newest output is in the window');
  const again = `follow-again-${process.pid}`;
  const againSeen = await watchFor(`${again} line 119`);
  await executeStreaming(session, `for i in range(120):\n    print(${JSON.stringify(again)}, 'line', i)`);
  await againSeen();
  await page.waitForFunction(atBottom, null, { timeout: WAIT_MS });
  failOnProblems();
});

// What the page's own script can do with the cookie it runs under: POST an execute (nothing else holds a token).
async function executeFromThePage(onPage, sessionId, code) {
  return onPage.evaluate(async ([id, source]) => {
    const response = await fetch(`/agent/v1/sessions/${id}/execute`, {
      method: 'POST', body: JSON.stringify({ code: source }), headers: { 'Content-Type': 'application/json' },
      credentials: 'same-origin',
    });
    return { status: response.status, body: await response.text() };
  }, [sessionId, code]);
}

test('a viewer link opens the page in another browser, which cannot execute', async () => {
  await openSessionPage();
  const share = await api('POST', `/agent/v1/sessions/${session}/share`, {});
  assert.match(share.token, /^cbv_/);
  const viewer = await openHeadlessChromium({ width: 1100, height: 900 });
  cleanups.push(() => viewer.close());
  await viewer.page.goto(`${relay.url}${share.view}?token=${share.token}`);
  assert.equal(viewer.page.url(), `${relay.url}/agent/v1/sessions/${session}/view`);
  await viewer.page.waitForFunction(() => document.getElementById('connection').textContent === 'live', null,
    { timeout: WAIT_MS });
  // The viewer sees the session: what comes next shows.
  const watched = `watched-by-the-viewer-${process.pid}`;
  await executeStreaming(session, `print(${JSON.stringify(watched)})`);
  await viewer.page.locator('section.cell .stream', { hasText: watched }).waitFor({ timeout: WAIT_MS });
  // From inside the page, with its cookie: refused; the operator's page cookie is refused the same.
  const marker = `viewer-ran-${process.pid}`;
  const code = `open(${JSON.stringify(`/workspace/${marker}`)}, 'w').write('x')\nprint(${JSON.stringify(marker)})`;
  const refused = await executeFromThePage(viewer.page, session, code);
  assert.ok([401, 403].includes(refused.status), `the viewer's execute: ${refused.status} ${refused.body}`);
  const operatorPage = await executeFromThePage(page, session, code);
  assert.ok([401, 403].includes(operatorPage.status), `the operator page's execute: ${operatorPage.status}`);
  console.log(`[live-page] execute from the page: viewer ${refused.status} ` +
    `${(JSON.parse(refused.body) || {}).reason}, operator's page ${operatorPage.status}`);
  // Nothing ran: an execute after them (the queue is in order) is the newest cell; no marker in the notebook,
  // no file in the workspace, nothing in either page.
  const barrier = `after-the-refusals-${process.pid}`;
  assert.equal((await executeStreaming(session, `print(${JSON.stringify(barrier)})`)).status, 'ok');
  await viewer.page.locator('section.cell .stream', { hasText: barrier }).waitFor({ timeout: WAIT_MS });
  const notebook = JSON.stringify(await api('GET', `/agent/v1/sessions/${session}/notebook`));
  assert.ok(notebook.includes(barrier), 'the notebook holds the cells run');
  assert.ok(!notebook.includes(marker), 'the refused code is in no cell');
  const file = await fetch(`${GATEWAY_URL}/agent/v1/sessions/${session}/files/${marker}`,
    { headers: { Authorization: `token ${GATEWAY_TOKEN}` } });
  assert.equal(file.status, 404, 'no file was written');
  for (const onPage of [viewer.page, page])
    assert.ok(!(await onPage.evaluate(() => document.getElementById('cells').textContent)).includes(marker));
  // The viewer's page shows the session's earlier cells too, hostile outputs included.
  assert.deepEqual(ownProblems(viewer.problems), []);
});

test('an approval shows pending in the page, then its decision', async () => {
  const second = await startGateway(['--network-allow', '*.test']);
  cleanups.push(() => second.stop());
  const asking = (await api('POST', '/agent/v1/sessions', { network: { allow: [], ask: true } }, second)).id;
  const watcher = await page.context().newPage();
  cleanups.push(() => watcher.close());
  await watcher.goto(`${second.url}/agent/v1/sessions/${asking}/view?token=${second.token}`);
  await watcher.waitForFunction(() => document.getElementById('connection').textContent === 'live', null,
    { timeout: WAIT_MS });
  // A request the policy asks about: held by the kernel's proxy until someone decides.
  let held = null;
  let heldSeen;
  const heldPromise = new Promise((resolve) => { heldSeen = resolve; });
  const running = executeStreaming(asking,
    "import urllib.request, urllib.error\ntry:\n    urllib.request.urlopen('http://held.test/x', timeout=60)\n" +
    "except urllib.error.HTTPError as error:\n    print('failed', error.code, error.read().decode())",
    (event) => {
      if (event.type === 'approval' && event.state === 'pending' && !held) { held = event; heldSeen(); }
    }, second);
  await Promise.race([heldPromise, running.then((end) => {
    if (!held) throw new Error(`the cell ended without an approval: ${JSON.stringify(end)}`);
  })]);
  const pending = watcher.locator('section.cell .approval.pending');
  await pending.waitFor({ timeout: WAIT_MS });
  assert.equal(await pending.textContent(),
    `network request GET held.test:80 waits for approval (id ${held.id}, ${held.timeout_s} s)`);
  assert.equal(await watcher.locator('section.cell .outcome').textContent(), 'running');
  // Denied through the API: the same line shows the decision and who made it; the cell ends.
  const decided = await api('POST', `/agent/v1/sessions/${asking}/approvals/${held.id}`, { decision: 'deny' }, second);
  assert.equal(decided.decision, 'deny');
  const denied = watcher.locator('section.cell .approval.decided.denied');
  await denied.waitFor({ timeout: WAIT_MS });
  assert.equal(await denied.textContent(), 'network request GET held.test:80: deny (by agent api)');
  assert.equal(await watcher.locator('section.cell .approval').count(), 1, 'one line per approval');
  assert.equal(await denied.evaluate((node) => getComputedStyle(node).borderLeftColor), 'rgb(207, 34, 46)', 'red');
  const end = await running;
  assert.equal(end.status, 'ok', JSON.stringify(end));
  await watcher.locator('section.cell .outcome', { hasText: 'ok' }).waitFor({ timeout: WAIT_MS });
  assert.match(await watcher.locator('section.cell .stream.stdout').textContent(),
    /^failed 403 cellblock egress: the request to held\.test:80 was denied by agent api/);
});

test('pages in hidden tabs let their streams go, so a reader can open more than six pages of one gateway', async () => {
  // Chromium keeps at most six HTTP/1.1 connections to one host and each live page's stream holds one: without
  // letting hidden pages' streams go, a seventh tab of the gateway would never load.
  const reader = await openHeadlessChromium({ width: 800, height: 600 });
  cleanups.push(reader.close);
  const context = reader.page.context();
  const viewUrl = `${relay.url}/agent/v1/sessions/${session}/view`;
  const connection = (tab, text) => tab.waitForFunction((expected) =>
    document.getElementById('connection').textContent === expected, text, { timeout: WAIT_MS });
  // What the browser does when a tab goes to the background or comes back (headless tabs are all visible).
  const setVisibility = (tab, state) => tab.evaluate((value) => {
    Object.defineProperty(document, 'visibilityState', { value, configurable: true });
    document.dispatchEvent(new Event('visibilitychange'));
  }, state);
  await reader.page.goto(`${viewUrl}?token=${GATEWAY_TOKEN}`);
  const tabs = [reader.page];
  for (let opened = 1; opened < 6; opened++) tabs.push(await context.newPage());
  for (const tab of tabs) {
    if (tab !== reader.page) await tab.goto(viewUrl);
    await connection(tab, 'live');
    await setVisibility(tab, 'hidden');
    await connection(tab, 'paused while hidden');
  }
  for (let more = 0; more < 2; more++) {
    const tab = await context.newPage();
    await tab.goto(viewUrl, { timeout: 10_000 });
    await connection(tab, 'live');
    tabs.push(tab);
  }
  // A tab shown again resumes from its last event: what ran while it was hidden shows, once.
  const marker = `while-hidden-${process.pid}`;
  const answer = await executeStreaming(session, `print(${JSON.stringify(marker)})`);
  assert.equal(answer.status, 'ok', JSON.stringify(answer));
  await setVisibility(tabs[0], 'visible');
  await connection(tabs[0], 'live');
  const shown = tabs[0].locator('section.cell .stream', { hasText: marker });
  await shown.waitFor({ timeout: WAIT_MS });
  assert.equal(await shown.count(), 1);
});
