'use strict';
// bench_live_page.py's browser half: the live page of one agent session (GET /agent/v1/sessions/{id}/view) in
// headless Chromium (tests/gateway/clients/headless-chromium.js, playwright-core from that directory's
// node_modules), and when what the kernel published reaches the page's DOM.
//
// Per round a cell runs through the agent API's NDJSON execute stream (the "IOPub" clock: the arrival of the
// stream's event, as tests/gateway/clients/live-page.test.js measures it); beside it a plain HTTP reader of the
// session's server-sent events (no browser: the floor any page has to wait for), and in the page a
// MutationObserver that notes when the last cell shows the text waited for. Every clock is
// performance.timeOrigin + performance.now() (epoch ms, sub-ms), in Node and in the page.
//   print: a one-line print; NDJSON stdout event -> the line in the page's DOM (and in the plain reader).
//   1 MB:  a cell printing 1,048,576 bytes whose last line is a marker; the gateway relays the first
//          --agent-inline-output-bytes (32 KiB) live, to the NDJSON stream and to the page alike, then the
//          cell's `end` event carries the head and the tail, so the marker reaches the page with the end:
//          NDJSON end event -> the marker in a cell marked ok.
//
// Environment: GATEWAY_URL, GATEWAY_TOKEN, SESSION, PRINTS, BIGS, BIG_BYTES, optional CHROMIUM.
// Prints one JSON object on stdout (arrays of milliseconds); progress on stderr.
const http = require('node:http');
const { performance } = require('node:perf_hooks');
const { openHeadlessChromium } = require('../gateway/clients/headless-chromium');

const GATEWAY_URL = process.env.GATEWAY_URL;
const TOKEN = process.env.GATEWAY_TOKEN;
const SESSION = process.env.SESSION;
const PRINTS = Number(process.env.PRINTS || 30);
const BIGS = Number(process.env.BIGS || 10);
const BIG_BYTES = Number(process.env.BIG_BYTES || 1048576);
const WAIT_MS = 120_000;
const now = () => performance.timeOrigin + performance.now();

// Runs `code` with the NDJSON stream; onEvent(event, arrivedAt) per line; resolves with the last event.
function executeStreaming(code, onEvent) {
  return new Promise((resolve, reject) => {
    const request = http.request(new URL(`${GATEWAY_URL}/agent/v1/sessions/${SESSION}/execute`), {
      method: 'POST',
      headers: { Authorization: `token ${TOKEN}`, 'Content-Type': 'application/json',
        Accept: 'application/x-ndjson' },
    }, (response) => {
      let buffer = '';
      let last = null;
      response.setEncoding('utf8');
      response.on('data', (chunk) => {
        const at = now();
        buffer += chunk;
        let newline;
        while ((newline = buffer.indexOf('\n')) >= 0) {
          const line = buffer.slice(0, newline).trim();
          buffer = buffer.slice(newline + 1);
          if (!line) continue;
          last = JSON.parse(line);
          onEvent(last, at);
        }
      });
      response.on('end', () => resolve(last));
      response.on('error', reject);
    });
    request.on('error', reject);
    request.end(JSON.stringify({ code }));
  });
}

// A plain reader of the session's events (what EventSource reads, without a page): `arrival(predicate)`
// resolves with the arrival time of the first event from now on that satisfies it.
function plainReader() {
  const waiting = [];
  let buffer = '';
  const request = http.get(new URL(`${GATEWAY_URL}/agent/v1/sessions/${SESSION}/events`), {
    headers: { Authorization: `token ${TOKEN}`, Accept: 'text/event-stream' },
  }, (response) => {
    response.setEncoding('utf8');
    response.on('data', (chunk) => {
      const at = now();
      buffer += chunk;
      let end;
      while ((end = buffer.indexOf('\n\n')) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block.split('\n').filter((l) => l.startsWith('data: ')).map((l) => l.slice(6)).join('\n');
        if (!data || waiting.length === 0) continue;
        const event = JSON.parse(data);
        for (let i = waiting.length - 1; i >= 0; i--) {
          if (waiting[i].predicate(event)) { waiting[i].resolve(at); waiting.splice(i, 1); }
        }
      }
    });
  });
  request.on('error', () => {});
  return {
    arrival: (predicate) => new Promise((resolve) => waiting.push({ predicate, resolve })),
    close: () => request.destroy(),
  };
}

async function main() {
  const browser = await openHeadlessChromium({ width: 1100, height: 900 });
  const { page } = browser;
  const reader = plainReader();
  const result = {
    print: { page: [], plain: [], eventSource: [] },
    big: { page: [], plain: [], eventSource: [], firstPage: [], firstPlain: [], firstEventSource: [], total: [] },
  };
  try {
    await page.goto(`${GATEWAY_URL}/agent/v1/sessions/${SESSION}/view?token=${TOKEN}`);
    await page.waitForFunction(() => document.getElementById('connection').textContent === 'live', null,
      { timeout: WAIT_MS });
    // watch(text, ended): the page notes when its last cell's outputs first show `text` (and, with `ended`, the
    // cell is marked ok).
    const watch = (text, ended) => page.evaluate(([marker, mustEnd]) => {
      window.seenAt = window.seenAt || {};
      const cells = document.getElementById('cells');
      const observer = new MutationObserver(() => {
        const cell = cells.lastElementChild;
        if (!cell || (mustEnd && !cell.classList.contains('ok'))) return;
        // Its outputs only: the cell's code, shown when the cell starts, holds the marker too.
        const outputs = cell.querySelector('.outputs');
        if (!outputs || !outputs.textContent.includes(marker)) return;
        window.seenAt[marker] = performance.timeOrigin + performance.now();
        observer.disconnect();
      });
      observer.observe(cells, { childList: true, subtree: true, characterData: true, attributes: true });
    }, [text, ended]);
    // The page's clock against Node's: the probe with the shortest round trip of 15 (its error is at most half
    // of that round trip); page times are corrected by it.
    const clockOffset = async () => {
      let best = null;
      for (let i = 0; i < 15; i++) {
        const sent = now();
        const pageNow = await page.evaluate(() => performance.timeOrigin + performance.now());
        const back = now();
        if (!best || back - sent < best.rtt) best = { rtt: back - sent, offset: pageNow - (sent + back) / 2 };
      }
      return best;
    };
    // The floor in the browser: a second EventSource of the same events in the page (its cookie), whose handler
    // notes when a message arrives, before any parsing or drawing: what the browser's delivery costs.
    await page.evaluate(() => {
      window.esSeen = {};
      window.esWatch = [];
      const source = new EventSource('events');
      source.onmessage = (message) => {
        const at = performance.timeOrigin + performance.now();
        if (!window.esWatch.length) return;
        const event = JSON.parse(message.data);
        window.esWatch = window.esWatch.filter(({ key, type, marker, start }) => {
          const text = type === 'end' ? event.stdout : event.text;
          if (event.type !== type || typeof text !== 'string') return true;
          if (start ? !text.startsWith(marker) : !text.includes(marker)) return true;
          window.esSeen[key] = at;
          return false;
        });
      };
    });
    const esWatch = (key, type, marker, start) => page.evaluate((entry) => window.esWatch.push(entry),
      { key, type, marker, start: Boolean(start) });
    const clock = await clockOffset();
    result.clock = [clock];
    const seen = async (text) => {
      const handle = await page.waitForFunction((marker) => window.seenAt && window.seenAt[marker], text,
        { timeout: WAIT_MS });
      return (await handle.jsonValue()) - clock.offset;
    };
    const esSeen = async (key) => {
      const handle = await page.waitForFunction((k) => window.esSeen[k], key, { timeout: WAIT_MS });
      return (await handle.jsonValue()) - clock.offset;
    };

    for (let round = -1; round < PRINTS; round++) {  // round -1 warms up, not recorded
      const marker = `live-print-${round + 1}-${process.pid}`;
      await watch(marker, false);
      const plainAt = reader.arrival((e) => e.type === 'stdout' && (e.text || '').includes(marker));
      await esWatch(marker, 'stdout', marker);
      let iopubAt = null;
      const answer = await executeStreaming(`print(${JSON.stringify(marker)})`, (event, at) => {
        if (event.type === 'stdout' && event.text.includes(marker) && iopubAt === null) iopubAt = at;
      });
      if (!answer || answer.status !== 'ok' || iopubAt === null) throw new Error(`print: ${JSON.stringify(answer)}`);
      const pageAt = await seen(marker);
      const plain = await plainAt;
      const inPage = await esSeen(marker);
      if (round >= 0) {
        result.print.page.push(pageAt - iopubAt);
        result.print.plain.push(plain - iopubAt);
        result.print.eventSource.push(inPage - iopubAt);
      }
    }
    process.stderr.write(`[bench] live page: ${PRINTS} prints measured\n`);

    for (let round = -1; round < BIGS; round++) {
      const marker = `live-big-end-${round + 1}-${process.pid}`;
      const head = `live-big-head-${round + 1}-${process.pid}`;
      // 1,048,576 bytes: a head line, lines of 'x' and the marker line last.
      const filler = BIG_BYTES - (head.length + 1) - (marker.length + 1);
      const code = `import sys\nsys.stdout.write(${JSON.stringify(head + '\n')} + ('x' * 1023 + '\\n') * ` +
        `${Math.floor(filler / 1024)} + 'y' * ${filler % 1024} + ${JSON.stringify(marker + '\n')})`;
      await watch(head, false);
      await watch(marker, true);
      const plainAt = reader.arrival((e) => e.type === 'end' && (e.stdout || '').includes(marker));
      const plainFirstAt = reader.arrival((e) => e.type === 'stdout' && (e.text || '').startsWith(head));
      await esWatch(marker, 'end', marker);
      await esWatch(head, 'stdout', head, true);
      let firstAt = null;
      let endAt = null;
      const answer = await executeStreaming(code, (event, at) => {
        if (event.type === 'stdout' && firstAt === null) firstAt = at;
        if (event.type === 'end') endAt = at;
      });
      if (!answer || answer.status !== 'ok' || firstAt === null || endAt === null)
        throw new Error(`1 MB print: ${JSON.stringify(answer).slice(0, 300)}`);
      // The stream, like the page, relays the first 32 KiB; its end carries the head and the tail.
      if (!answer.stdout.startsWith(head) || !answer.stdout.endsWith(`${marker}\n`))
        throw new Error(`1 MB print: the end event's stdout is not the head and tail: ${answer.stdout.length}`);
      result.bigSaved = answer.saved;
      const firstPageAt = await seen(head);
      const pageAt = await seen(marker);
      const plain = await plainAt;
      const plainFirst = await plainFirstAt;
      const inPage = await esSeen(marker);
      const inPageFirst = await esSeen(head);
      if (round >= 0) {
        result.big.eventSource.push(inPage - endAt);
        result.big.firstEventSource.push(inPageFirst - firstAt);
        result.big.page.push(pageAt - endAt);
        result.big.plain.push(plain - endAt);
        result.big.firstPage.push(firstPageAt - firstAt);
        result.big.firstPlain.push(plainFirst - firstAt);
        result.big.total.push(pageAt - firstAt);
      }
    }
    result.clock.push(await clockOffset());
    process.stderr.write(`[bench] live page: ${BIGS} outputs of ${BIG_BYTES} bytes measured\n`);
    const problems = browser.problems.filter((p) => !/net::ERR_|Failed to load resource|EventSource/.test(p));
    if (problems.length) throw new Error(`the page had errors: ${problems.join('; ')}`);
    result.bigCellText = await page.evaluate(() => document.getElementById('cells').lastElementChild.textContent.length);
  } finally {
    reader.close();
    await browser.close();
  }
  process.stdout.write(`${JSON.stringify(result)}\n`);
}

// ------------------------------------------------------------------------- MODE=pages: the gateway's CPU
// The same measure as bench_live_page.py's plain readers, with live pages: per round and page count a new
// session, that many pages of it open in one browser, a first cell every page shows (so each is subscribed),
// then the busy cell (BUSY_CODE, run with a one-call execute as the Python side does); the gateway's
// utime+stime (/proc/GATEWAY_PID/stat) from the execute until every page shows the busy cell ended.
async function api(method, path, body) {
  const response = await fetch(`${GATEWAY_URL}${path}`, {
    method,
    headers: { Authorization: `token ${TOKEN}`, 'Content-Type': 'application/json' },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await response.text();
  if (!response.ok) throw new Error(`${method} ${path}: ${response.status} ${text.slice(0, 300)}`);
  return text ? JSON.parse(text) : null;
}

function gatewayCpuSeconds() {
  const fields = require('node:fs').readFileSync(`/proc/${process.env.GATEWAY_PID}/stat`, 'utf8')
    .split(') ').pop().split(' ');
  return (Number(fields[11]) + Number(fields[12])) / 100;  // utime, stime in ticks of 1/100 s (CLK_TCK)
}

// Each page in a browser context of its own, as N people's browsers: Chromium opens at most 6 HTTP/1.1
// connections to one host per profile, each live page holds one (its EventSource), so a 7th page of the same
// gateway in one profile never loads.
async function pagesMain() {
  const counts = process.env.PAGE_COUNTS.split(',').map(Number);
  const rounds = Number(process.env.ROUNDS || 1);
  const { chromium } = require(require.resolve('playwright-core',
    { paths: [require('node:path').join(__dirname, '..', 'gateway', 'clients')] }));
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    headless: true,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  });
  const newPage = async () => (await browser.newContext({ viewport: { width: 900, height: 700 } })).newPage();
  const measured = Object.fromEntries(counts.map((count) => [count, []]));
  const endedIn = (page, cell) => page.waitForFunction((number) => {
    const node = document.querySelector(`section.cell[data-cell="${number}"]`);
    return node && node.classList.contains('ok');
  }, cell, { timeout: WAIT_MS, polling: 'raf' });
  try {
    for (let round = 0; round < rounds; round++) {
      for (const count of round % 2 === 0 ? counts : [...counts].reverse()) {
        const session = (await api('POST', '/agent/v1/sessions', {})).id;
        const pages = await Promise.all(Array.from({ length: count }, newPage));
        try {
          await Promise.all(pages.map((page) => page.goto(
            `${GATEWAY_URL}/agent/v1/sessions/${session}/view?token=${TOKEN}`, { timeout: WAIT_MS })));
          await api('POST', `/agent/v1/sessions/${session}/execute`, { code: 'pass' });
          await Promise.all(pages.map((page) => endedIn(page, 0)));
          const before = gatewayCpuSeconds();
          const started = now();
          const answer = await api('POST', `/agent/v1/sessions/${session}/execute`, { code: process.env.BUSY_CODE });
          if (answer.status !== 'ok') throw new Error(`busy cell: ${JSON.stringify(answer).slice(0, 300)}`);
          await Promise.all(pages.map((page) => endedIn(page, 1)));
          const cpu = gatewayCpuSeconds() - before;
          measured[count].push({ cpu_s: cpu, seconds: (now() - started) / 1000 });
          process.stderr.write(`[bench] live page: round ${round + 1}, ${count} pages: gateway ${cpu.toFixed(2)} ` +
            `CPU s over ${((now() - started) / 1000).toFixed(2)} s\n`);
        } finally {
          await Promise.all(pages.map((page) => page.context().close()));
          await api('DELETE', `/agent/v1/sessions/${session}`);
        }
      }
    }
  } finally {
    await browser.close();
  }
  process.stdout.write(`${JSON.stringify(measured)}\n`);
}

(process.env.MODE === 'pages' ? pagesMain() : main())
  .catch((error) => { process.stderr.write(`${error.stack || error}\n`); process.exit(1); });
