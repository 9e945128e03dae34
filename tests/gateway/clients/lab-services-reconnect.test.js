'use strict';
// A JupyterLab kernel connection (@jupyterlab/services) across a gateway crash: the client keeps its kernel object,
// the gateway is killed with SIGKILL and started again on the same state directory and port by the test that runs
// this script, and the connection's own reconnect must land on the same kernel with its state.
//
// Environment: GATEWAY_URL, GATEWAY_TOKEN, SYNC_DIR (this script writes SYNC_DIR/ready with the kernel id once
// `secret` is defined, then waits for SYNC_DIR/restarted, written by the test after the new gateway answers).
// Run: node --test lab-services-reconnect.test.js
const { test, after } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const WebSocket = require('ws');
const { ServerConnection, KernelManager, KernelAPI } = require('@jupyterlab/services');

const GATEWAY_URL = process.env.GATEWAY_URL;
const GATEWAY_TOKEN = process.env.GATEWAY_TOKEN ?? '';
const SYNC_DIR = process.env.SYNC_DIR;
// Generous: a loaded 2-core CI machine may be slow to spawn a confined kernel or to restart the gateway.
const STEP_TIMEOUT_MS = 120_000;

const settings = ServerConnection.makeSettings({ baseUrl: GATEWAY_URL, token: GATEWAY_TOKEN, appendToken: true,
                                                 WebSocket });

function withTimeout(promise, what, ms = STEP_TIMEOUT_MS) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms waiting for ${what}`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

function until(condition, what) {
  return withTimeout(new Promise((resolve) => {
    const poll = () => (condition() ? resolve() : setTimeout(poll, 100));
    poll();
  }), what);
}

async function execute(kernel, code) {
  let stdout = '';
  const future = kernel.requestExecute({ code, stop_on_error: true });
  future.onIOPub = (msg) => {
    if (msg.header.msg_type === 'stream' && msg.content.name === 'stdout') stdout += msg.content.text;
  };
  const reply = await withTimeout(future.done, `the reply to ${JSON.stringify(code)}`);
  return { reply, stdout };
}

let manager;
let kernel;

after(async () => {
  if (kernel && !kernel.isDisposed) await kernel.shutdown().catch(() => {});
  manager?.dispose();
});

test('the kernel connection survives a gateway kill -9 and restart with its state', async () => {
  assert.ok(GATEWAY_URL && SYNC_DIR, 'GATEWAY_URL and SYNC_DIR must be set');
  manager = new KernelManager({ serverSettings: settings });
  await withTimeout(manager.ready, 'the kernel manager');
  kernel = await withTimeout(manager.startNew(), 'POST /api/kernels');
  const before = await execute(kernel, 'secret = 6 * 7');
  assert.equal(before.reply.content.status, 'ok');
  const statuses = [];
  kernel.connectionStatusChanged.connect((_, status) => statuses.push(status));
  fs.writeFileSync(path.join(SYNC_DIR, 'ready'), kernel.id);

  await until(() => fs.existsSync(path.join(SYNC_DIR, 'restarted')), 'the test to restart the gateway');
  // The old WebSocket died with the gateway; the connection noticed and reconnects by itself.
  await until(() => statuses.includes('connecting') && kernel.connectionStatus === 'connected',
              `the connection to reconnect (statuses so far: ${statuses.join(', ')})`);
  const after = await execute(kernel, 'print(secret)');
  assert.equal(after.reply.content.status, 'ok');
  assert.equal(after.stdout, '42\n', 'the variable defined before the crash is still there');
  const model = await KernelAPI.getKernelModel(kernel.id, settings);
  assert.equal(model?.id, kernel.id, 'the restarted gateway lists the same kernel id');
  console.log(`re-adopted ${kernel.id}`);
});
