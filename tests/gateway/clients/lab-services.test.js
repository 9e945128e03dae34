'use strict';
// Drives a Kernel-Gateway-compatible server with @jupyterlab/services, the client library JupyterLab itself uses,
// the way JupyterLab would: kernelspecs, start, execute, streaming output, interrupt, restart, shutdown.
// Each step asserts what a JupyterLab user would notice (outputs, errors, cleared state), not wire details.
//
// Environment: GATEWAY_URL (http://host:port), GATEWAY_TOKEN, optional KERNEL_NAME (default: the server's default spec).
// Run: node --test lab-services.test.js
const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const WebSocket = require('ws');
const { ServerConnection, KernelManager, KernelAPI, KernelSpecAPI } = require('@jupyterlab/services');

const V1_PROTOCOL = 'v1.kernel.websocket.jupyter.org';
const GATEWAY_URL = requiredEnv('GATEWAY_URL');
const GATEWAY_TOKEN = process.env.GATEWAY_TOKEN ?? '';
// Generous: a loaded 2-core CI machine may be slow to spawn a confined kernel.
const STEP_TIMEOUT_MS = 90_000;

function requiredEnv(name) {
  const value = process.env[name];
  if (!value) throw new Error(`${name} must be set (e.g. ${name}=http://127.0.0.1:8888)`);
  return value;
}

// A `ws` WebSocket that records what the handshake negotiated and which frame kinds arrived, so the tests can
// tell the v1 binary protocol from the legacy JSON one. With offerProtocols=false it behaves like a client that
// offers no subprotocol (Jupyter Server's GatewayClient, AutoGen, ...).
function recordingWebSocket({ offerProtocols }, connections) {
  return class RecordingWebSocket extends WebSocket {
    constructor(url, protocols) {
      const offered = offerProtocols ? [...(protocols ?? [])] : [];
      super(url, offered);
      const record = { offered, selected: null, binaryFrames: 0, textFrames: 0 };
      connections.push(record);
      this.on('open', () => { record.selected = this.protocol; });
      this.on('message', (_data, isBinary) => { if (isBinary) record.binaryFrames++; else record.textFrames++; });
    }
  };
}

function serverSettings(WebSocketClass, token = GATEWAY_TOKEN) {
  return ServerConnection.makeSettings({ baseUrl: GATEWAY_URL, token, appendToken: true, WebSocket: WebSocketClass });
}

function withTimeout(promise, what, ms = STEP_TIMEOUT_MS) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms waiting for ${what}`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

// Executes code and returns the execute_reply plus every IOPub message of this request with its arrival time.
async function execute(kernel, code) {
  const iopub = [];
  const future = kernel.requestExecute({ code, stop_on_error: true });
  future.onIOPub = (msg) => { iopub.push({ msg, receivedAt: performance.now() }); };
  const reply = await withTimeout(future.done, `the reply and idle status of ${JSON.stringify(code)}`);
  return { reply, iopub, repliedAt: performance.now() };
}

const outputsOfType = (iopub, type) => iopub.filter(({ msg }) => msg.header.msg_type === type).map(({ msg }) => msg);
const streamText = (iopub, name = 'stdout') =>
  outputsOfType(iopub, 'stream').filter((m) => m.content.name === name).map((m) => m.content.text).join('');

async function waitForIdle(kernel) {
  if (kernel.status === 'idle' && kernel.connectionStatus === 'connected') return;
  await withTimeout(new Promise((resolve) => {
    const check = () => {
      if (kernel.status === 'idle' && kernel.connectionStatus === 'connected') {
        kernel.statusChanged.disconnect(check);
        kernel.connectionStatusChanged.disconnect(check);
        resolve();
      }
    };
    kernel.statusChanged.connect(check);
    kernel.connectionStatusChanged.connect(check);
    check();
  }), `kernel ${kernel.id} to be connected and idle (status ${kernel.status}, connection ${kernel.connectionStatus})`);
}

// The Node process must not exit between steps, and must exit at the end even if a socket is left open.
let manager;
let kernel;
let kernelName;
const v1Connections = [];

before(async () => {
  manager = new KernelManager({ serverSettings: serverSettings(recordingWebSocket({ offerProtocols: true }, v1Connections)) });
  await withTimeout(manager.ready, 'the kernel manager to load the running kernel list');
});

after(async () => {
  // Best effort: never leave a kernel behind on the server if a step failed half way.
  if (kernel && !kernel.isDisposed && kernel.status !== 'dead') {
    await kernel.shutdown().catch(() => {});
  }
  manager?.dispose();
});

test('a wrong token is refused with 401 and the server keeps serving', async () => {
  const settings = serverSettings(WebSocket, `wrong-${GATEWAY_TOKEN}`);
  await assert.rejects(KernelAPI.listRunning(settings), (error) => {
    assert.ok(error instanceof ServerConnection.ResponseError, `expected a ResponseError, got ${error}`);
    assert.equal(error.response.status, 401);
    return true;
  });
  const running = await KernelAPI.listRunning(serverSettings(WebSocket));
  assert.ok(Array.isArray(running), 'with the right token the kernel list is an array');
});

test('kernelspecs name a default that JupyterLab can launch', async () => {
  const specs = await KernelSpecAPI.getSpecs(serverSettings(WebSocket));
  assert.ok(specs.default, 'the server names a default kernelspec');
  assert.ok(specs.kernelspecs[specs.default], `the default "${specs.default}" is among the listed kernelspecs`);
  kernelName = process.env.KERNEL_NAME || specs.default;
  const spec = specs.kernelspecs[kernelName];
  assert.ok(spec, `kernelspec "${kernelName}" is listed`);
  assert.equal(spec.language.toLowerCase(), 'python');
  assert.ok(spec.display_name, 'the kernelspec has a display name for the launcher');
});

test('start a kernel over the v1 subprotocol and wait until it is idle', async () => {
  assert.ok(kernelName, 'the kernelspec step ran first');
  kernel = await withTimeout(manager.startNew({ name: kernelName }), `POST /api/kernels for "${kernelName}"`);
  await waitForIdle(kernel);
  const info = await withTimeout(kernel.info, 'kernel_info_reply');
  assert.equal(info.status, 'ok');
  assert.equal(info.language_info.name, 'python');

  const current = v1Connections.at(-1);
  assert.ok(current, 'the kernel connection opened a WebSocket');
  assert.deepEqual(current.offered, [V1_PROTOCOL], 'JupyterLab offers the v1 subprotocol');
  assert.equal(current.selected, V1_PROTOCOL, 'the server selects the v1 subprotocol when it is offered');
  assert.ok(current.binaryFrames > 0, 'v1 frames arrive as binary');
  assert.equal(current.textFrames, 0, 'no legacy JSON text frames are mixed into a v1 connection');

  const model = await KernelAPI.getKernelModel(kernel.id, serverSettings(WebSocket));
  assert.equal(model?.id, kernel.id, 'GET /api/kernels/{id} knows the new kernel');
  assert.ok(model.connections >= 1, `the model counts our open WebSocket (connections=${model.connections})`);
});

test('1+1 shows Out: 2', async () => {
  const { reply, iopub } = await execute(kernel, '1+1');
  assert.equal(reply.content.status, 'ok');
  const results = outputsOfType(iopub, 'execute_result');
  assert.equal(results.length, 1, 'exactly one execute_result');
  assert.equal(results[0].content.data['text/plain'], '2');
  assert.equal(results[0].content.execution_count, reply.content.execution_count);
  const inputs = outputsOfType(iopub, 'execute_input');
  assert.equal(inputs.length, 1, 'the execute_input is broadcast on IOPub');
  assert.equal(inputs[0].content.code, '1+1');
});

test('print output streams while the cell is still running', async () => {
  // The cell cannot end by itself (it sleeps 600 s after printing): the lines arrive while it runs or never.
  const future = kernel.requestExecute({
    code: 'import time\nfor i in range(3):\n    print(f"line {i}", flush=True)\ntime.sleep(600)',
  });
  const iopub = [];
  let finished = false;
  future.onIOPub = (msg) => { iopub.push({ msg }); };
  future.done.then(() => { finished = true; }, () => { finished = true; });
  await withTimeout(new Promise((resolve) => {
    const timer = setInterval(() => {
      if (streamText(iopub) === 'line 0\nline 1\nline 2\n') { clearInterval(timer); resolve(); }
    }, 50);
  }), 'the printed lines while the cell runs');
  assert.equal(finished, false, 'the cell was still running when its output arrived');
  await withTimeout(kernel.interrupt(), 'POST /api/kernels/{id}/interrupt');
  const reply = await withTimeout(future.done, 'the interrupted cell to finish');
  assert.equal(reply.content.ename, 'KeyboardInterrupt');
});

test('an error shows the exception name and traceback', async () => {
  const { reply, iopub } = await execute(kernel, '1/0');
  assert.equal(reply.content.status, 'error');
  const errors = outputsOfType(iopub, 'error');
  assert.equal(errors.length, 1);
  assert.equal(errors[0].content.ename, 'ZeroDivisionError');
  assert.ok(errors[0].content.traceback.join('\n').includes('ZeroDivisionError'));
});

test('interrupt stops time.sleep(600) with KeyboardInterrupt', async () => {
  // The sleep outlasts every wait below many times over: only a working interrupt ends the cell in time.
  const future = kernel.requestExecute({
    code: 'import time\nprint("sleeping", flush=True)\ntime.sleep(600)\nprint("not interrupted")',
  });
  const iopub = [];
  future.onIOPub = (msg) => { iopub.push({ msg }); };
  // Interrupt only once the code is really running (it printed), as a user pressing the stop button would.
  await withTimeout(new Promise((resolve) => {
    const timer = setInterval(() => {
      // The whole line: print writes 'sleeping' and '\n' separately, and an interrupt between them is legal.
      if (streamText(iopub).includes('sleeping\n')) { clearInterval(timer); resolve(); }
    }, 50);
  }), 'the sleeping cell to print');
  await withTimeout(kernel.interrupt(), 'POST /api/kernels/{id}/interrupt');
  const reply = await withTimeout(future.done, 'the interrupted cell to finish');
  assert.equal(reply.content.status, 'error');
  assert.equal(reply.content.ename, 'KeyboardInterrupt');
  const errors = outputsOfType(iopub, 'error');
  assert.equal(errors.length, 1, 'the KeyboardInterrupt is shown as an error output');
  assert.equal(errors[0].content.ename, 'KeyboardInterrupt');
  assert.ok(errors[0].content.traceback.join('\n').replace(/\x1b\[[0-9;]*m/g, '').includes('time.sleep(600)'),
    'the interrupt arrived while the sleep ran');
  assert.equal(streamText(iopub), 'sleeping\n', 'code after the sleep did not run');
  // The kernel stays usable after an interrupt.
  const { reply: after } = await execute(kernel, '"still alive"');
  assert.equal(after.content.status, 'ok');
});

test('restart clears the kernel state, keeps the kernel id, and the new kernel stays', async () => {
  const { reply: setReply } = await execute(kernel, 'remembered = 41');
  assert.equal(setReply.content.status, 'ok');
  const { iopub: beforeRestart } = await execute(kernel, 'remembered + 1');
  assert.equal(outputsOfType(beforeRestart, 'execute_result')[0]?.content.data['text/plain'], '42');

  const idBefore = kernel.id;
  await withTimeout(kernel.restart(), 'POST /api/kernels/{id}/restart and the reconnect');
  await waitForIdle(kernel);
  assert.equal(kernel.id, idBefore, 'a restart keeps the kernel id');
  assert.equal(v1Connections.at(-1).selected, V1_PROTOCOL, 'the reconnect after restart negotiates v1 again');

  // From here on the user works in the restarted kernel: nothing may restart it again behind their back.
  const statusesSeen = [];
  const watchStatus = (_sender, status) => { statusesSeen.push(status); };
  kernel.statusChanged.connect(watchStatus);
  try {
    const { reply: defined } = await execute(kernel, 'after_restart = "kept"');
    assert.equal(defined.content.status, 'ok');

    const { reply, iopub } = await execute(kernel, 'remembered');
    assert.equal(reply.content.status, 'error', 'the variable from before the restart is gone');
    assert.equal(outputsOfType(iopub, 'error')[0]?.content.ename, 'NameError');
    const { iopub: fresh } = await execute(kernel, '1+1');
    assert.equal(outputsOfType(fresh, 'execute_result')[0]?.content.data['text/plain'], '2');

    await new Promise((resolve) => setTimeout(resolve, 3000));
    const { reply: readBack, iopub: readBackIopub } = await execute(kernel, 'after_restart');
    assert.ok(!statusesSeen.includes('autorestarting') && !statusesSeen.includes('restarting'),
      `the kernel restarted again on its own after the requested restart (statuses: ${statusesSeen})`);
    assert.equal(readBack.content.status, 'ok', 'a variable defined right after the restart is still there 3 s later');
    assert.equal(outputsOfType(readBackIopub, 'execute_result')[0]?.content.data['text/plain'], "'kept'");
  } finally {
    kernel.statusChanged.disconnect(watchStatus);
  }
});

test('a second client offering no subprotocol gets legacy JSON and watches the first client\'s cells', async () => {
  const legacyConnections = [];
  const legacyManager = new KernelManager({
    serverSettings: serverSettings(recordingWebSocket({ offerProtocols: false }, legacyConnections)),
  });
  try {
    await withTimeout(legacyManager.ready, 'a second kernel manager');
    const second = legacyManager.connectTo({ model: { id: kernel.id, name: kernel.name } });
    try {
      await waitForIdle(second);
      const { reply, iopub } = await execute(second, '6*7');
      assert.equal(reply.content.status, 'ok');
      assert.equal(outputsOfType(iopub, 'execute_result')[0]?.content.data['text/plain'], '42');
      const record = legacyConnections.at(-1);
      assert.equal(record.selected, '', 'no subprotocol is selected when none is offered');
      assert.ok(record.textFrames > 0, 'legacy frames without buffers arrive as JSON text');

      // What JupyterLab's "Show All Kernel Activity" relies on: the second client sees the first client's
      // execute_input and outputs on IOPub, but the execute_reply goes only to the client that asked.
      const seenBySecond = [];
      const collect = (_sender, { msg, direction }) => { if (direction === 'recv') seenBySecond.push(msg); };
      second.anyMessage.connect(collect);
      const { reply: firstReply, iopub: firstIopub } = await execute(kernel, 'print("seen by both")');
      assert.equal(streamText(firstIopub), 'seen by both\n');
      const requestId = firstReply.parent_header.msg_id;
      const ofRequest = () => seenBySecond.filter((m) => m.parent_header?.msg_id === requestId);
      // IOPub to the second socket may trail the reply to the first one by a little: wait for its idle status.
      await withTimeout(new Promise((resolve) => {
        const timer = setInterval(() => {
          if (ofRequest().some((m) => m.header.msg_type === 'status' && m.content.execution_state === 'idle')) {
            clearInterval(timer);
            resolve();
          }
        }, 50);
      }), 'the second client to see the first client\'s cell finish');
      second.anyMessage.disconnect(collect);
      const types = ofRequest().map((m) => m.header.msg_type);
      assert.ok(types.includes('execute_input'), `the second client sees the code being run (saw ${types})`);
      assert.equal(ofRequest().filter((m) => m.header.msg_type === 'stream').map((m) => m.content.text).join(''),
        'seen by both\n', 'the second client sees the output');
      assert.ok(!types.includes('execute_reply'), 'the reply goes only to the client that sent the request');
    } finally {
      second.dispose(); // closes only this connection; the kernel keeps running for the first client
    }
  } finally {
    legacyManager.dispose();
  }
  const { reply } = await execute(kernel, '1+1');
  assert.equal(reply.content.status, 'ok', 'the first client is unaffected by the second one leaving');
});

test('shutdown removes the kernel from the server', async () => {
  const id = kernel.id;
  await withTimeout(kernel.shutdown(), 'DELETE /api/kernels/{id}');
  assert.equal(kernel.status, 'dead');
  const model = await KernelAPI.getKernelModel(id, serverSettings(WebSocket));
  assert.equal(model, undefined, 'GET /api/kernels/{id} answers 404 after shutdown');
  const running = await KernelAPI.listRunning(serverSettings(WebSocket));
  assert.ok(!running.some((k) => k.id === id), 'the kernel is no longer listed');
});
