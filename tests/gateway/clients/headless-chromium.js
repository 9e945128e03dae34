'use strict';
// Debian's Chromium, headless, in a throw-away profile, for the browser tests here (classic-notebook.test.js,
// jupyterlab.test.js). The page's errors are collected for failure messages: a broken WebSocket or a JS error
// usually shows up there first.
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { chromium } = require('playwright-core');

const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';

// Resolves to { page, problems, close }; `close` removes the profile.
async function openHeadlessChromium(viewport) {
  const userDataDir = fs.mkdtempSync(path.join(os.tmpdir(), 'cellblock-chromium-'));
  const context = await chromium.launchPersistentContext(userDataDir, {
    executablePath: CHROMIUM,
    headless: true,
    viewport,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  });
  const page = context.pages()[0] ?? await context.newPage();
  const problems = [];
  page.on('pageerror', (error) => problems.push(`page error: ${error.message}`));
  page.on('console', (message) => {
    if (message.type() === 'error') problems.push(`console error: ${message.text()}`);
  });
  const close = async () => {
    await context.close();
    fs.rmSync(userDataDir, { recursive: true, force: true });
  };
  return { page, problems, close };
}

module.exports = { openHeadlessChromium };
