'use strict';
// The live pages of cellblock's agent sessions (served by the gateway, gateway/src/agent/live_view.cpp):
// body[data-page=session] follows one session's cells through its event stream (../events, server-sent
// events), body[data-page=list] polls the sessions. No framework, no build step. Everything an agent wrote is
// either text (textContent, never markup) or rendered in a sandboxed frame (view/static/frame.html: no
// same-origin, a policy that allows no request at all).
(() => {
  const $ = (selector) => document.querySelector(selector);
  function element(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }
  const joined = (value) => (Array.isArray(value) ? value.join('') : String(value ?? ''));

  function setConnection(text, state) {
    const node = $('#connection');
    if (!node) return;
    node.textContent = text;
    node.className = `connection ${state}`;
  }

  // ------------------------------------------------------------------------------------ ANSI SGR → spans
  // Appends `text` to `parent`: runs of text as text nodes or spans carrying the current SGR state (kept on
  // the parent across calls, so a colour set in one chunk of a stream holds in the next). Other escape
  // sequences are dropped; an escape cut at the end of a chunk waits for the next one.
  const ESCAPE = /\x1b\[([0-9;:]*)([@-~])|\x1b[@-Z\\-_]|\x1b$|\x1b\[[0-9;:]*$/g;
  function rgbOf256(n) {
    if (n < 16) return null;
    if (n >= 232) { const v = 8 + (n - 232) * 10; return `rgb(${v},${v},${v})`; }
    const i = n - 16, steps = [0, 95, 135, 175, 215, 255];
    return `rgb(${steps[Math.floor(i / 36)]},${steps[Math.floor(i / 6) % 6]},${steps[i % 6]})`;
  }
  function applySgr(state, codes) {
    const list = codes === '' ? [0] : codes.split(/[;:]/).map((c) => Number(c) || 0);
    for (let i = 0; i < list.length; i++) {
      const c = list[i];
      if (c === 0) Object.assign(state, { fg: null, bg: null, bold: false, dim: false, italic: false, underline: false });
      else if (c === 1) state.bold = true;
      else if (c === 2) state.dim = true;
      else if (c === 3) state.italic = true;
      else if (c === 4) state.underline = true;
      else if (c === 22) state.bold = state.dim = false;
      else if (c === 23) state.italic = false;
      else if (c === 24) state.underline = false;
      else if (c >= 30 && c <= 37) state.fg = c - 30;
      else if (c >= 90 && c <= 97) state.fg = c - 90 + 8;
      else if (c === 39) state.fg = null;
      else if (c >= 40 && c <= 47) state.bg = c - 40;
      else if (c >= 100 && c <= 107) state.bg = c - 100 + 8;
      else if (c === 49) state.bg = null;
      else if (c === 38 || c === 48) {
        let colour = null;
        if (list[i + 1] === 5) { const n = list[i + 2] ?? 0; colour = n < 16 ? n : rgbOf256(n); i += 2; }
        else if (list[i + 1] === 2) { colour = `rgb(${list[i + 2] ?? 0},${list[i + 3] ?? 0},${list[i + 4] ?? 0})`; i += 4; }
        if (c === 38) state.fg = colour; else state.bg = colour;
      }
    }
  }
  function styledRun(state, text) {
    if (!state.fg && state.fg !== 0 && !state.bg && state.bg !== 0 && !state.bold && !state.dim && !state.italic && !state.underline)
      return document.createTextNode(text);
    const span = element('span', '', text);
    const classes = [];
    if (state.bold) classes.push('ansi-bold');
    if (state.dim) classes.push('ansi-dim');
    if (state.italic) classes.push('ansi-italic');
    if (state.underline) classes.push('ansi-underline');
    if (typeof state.fg === 'number') classes.push(`ansi-fg-${state.fg}`); else if (state.fg) span.style.color = state.fg;
    if (typeof state.bg === 'number') classes.push(`ansi-bg-${state.bg}`); else if (state.bg) span.style.background = state.bg;
    span.className = classes.join(' ');
    return span;
  }
  function appendAnsi(parent, text) {
    const state = parent.ansiState || (parent.ansiState = { fg: null, bg: null });
    text = (parent.ansiCarry || '') + text;
    parent.ansiCarry = '';
    const fragment = document.createDocumentFragment();
    let at = 0;
    ESCAPE.lastIndex = 0;
    for (let match; (match = ESCAPE.exec(text));) {
      if (match.index > at) fragment.append(styledRun(state, text.slice(at, match.index)));
      at = match.index + match[0].length;
      if (match.index + match[0].length === text.length && !match[2] && match[0].startsWith('\x1b') &&
          (match[0] === '\x1b' || /^\x1b\[[0-9;:]*$/.test(match[0]))) {
        parent.ansiCarry = match[0];  // cut in the middle: completed by the next chunk
        break;
      }
      if (match[2] === 'm') applySgr(state, match[1]);
    }
    if (at < text.length) fragment.append(styledRun(state, text.slice(at)));
    parent.append(fragment);
  }

  // A traceback: ANSI when it has it (recorded cells keep the kernel's colours); the agent API's plain
  // traceback is coloured here the way IPython does (locations, the arrow line, the exception line).
  function renderTraceback(pre, text) {
    if (text.includes('\x1b')) return appendAnsi(pre, text);
    const lines = text.split('\n');
    let last = lines.length - 1;
    while (last > 0 && lines[last].trim() === '') last--;
    lines.forEach((line, index) => {
      let className = '';
      if (index === last) className = 'tb-exc';
      else if (/^\s*(File "|Cell In ?\[|Input In ?\[|Traceback \(most recent call last\))/.test(line)) className = 'tb-loc';
      else if (/^-*>\s*\d+/.test(line)) className = 'tb-arrow';
      pre.append(className ? element('span', className, line) : document.createTextNode(line));
      if (index < lines.length - 1) pre.append('\n');
    });
  }

  // -------------------------------------------------------------------------------- sandboxed outputs
  const FRAME_POLICY = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'";
  const FRAME_HEAD = `<!doctype html><meta http-equiv="Content-Security-Policy" content="${FRAME_POLICY}">` +
    '<meta charset="utf-8"><style>body{margin:0;padding:4px;font:14px system-ui,sans-serif}</style>';
  // Tells the page the frame's height (the page matches the message to the frame it came from).
  const FRAME_TAIL = '<script>(function(){function s(){parent.postMessage({cellblockFrameHeight:' +
    'document.documentElement.scrollHeight},"*")}addEventListener("load",s);' +
    'if(window.ResizeObserver)new ResizeObserver(s).observe(document.documentElement);s()})()</script>';
  const escapeHtml = (text) => text.replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' })[c]);
  const frameOf = new WeakMap();  // frame window -> iframe
  addEventListener('message', (event) => {
    const iframe = frameOf.get(event.source);
    if (!iframe || !event.data || typeof event.data.cellblockFrameHeight !== 'number') return;
    iframe.style.height = `${Math.min(Math.max(event.data.cellblockFrameHeight, 16), 3000)}px`;
  });
  function openFrame(holder) {
    const iframe = document.createElement('iframe');
    iframe.setAttribute('sandbox', 'allow-scripts');
    iframe.setAttribute('referrerpolicy', 'no-referrer');
    iframe.title = 'output';
    const documentText = holder.frameDocument;
    iframe.addEventListener('load', () => iframe.contentWindow.postMessage({ cellblockFrameDocument: documentText }, '*'),
      { once: true });
    iframe.src = 'view/static/frame.html';
    holder.append(iframe);
    frameOf.set(iframe.contentWindow, iframe);
  }
  // Frames are made when they come near the screen: a session of 1,000 HTML outputs opens without them.
  const frameObserver = 'IntersectionObserver' in window
    ? new IntersectionObserver((entries) => {
      for (const entry of entries) {
        if (!entry.isIntersecting) continue;
        frameObserver.unobserve(entry.target);
        openFrame(entry.target);
      }
    }, { rootMargin: '800px' })
    : null;
  function framedOutput(body) {
    const holder = element('div', 'frame-holder');
    holder.frameDocument = FRAME_HEAD + body + FRAME_TAIL;
    if (frameObserver) frameObserver.observe(holder); else openFrame(holder);
    return holder;
  }

  // A MIME bundle (execute_result, display_data): the richest kind it has, hostile kinds framed.
  function renderBundle(data) {
    data = data || {};
    const get = (mime) => (mime in data ? joined(data[mime]) : null);
    let value;
    if ((value = get('application/javascript')) !== null)
      return framedOutput(`<script>${value.replace(/<\/script/gi, '<\\/script')}</script>`);
    if ((value = get('text/html')) !== null) return framedOutput(value);
    if ((value = get('image/svg+xml')) !== null) return framedOutput(value);
    for (const mime of ['image/png', 'image/jpeg', 'image/gif', 'image/webp']) {
      if ((value = get(mime)) === null) continue;
      const base64 = value.replace(/\s+/g, '');
      if (!/^[A-Za-z0-9+/]*={0,2}$/.test(base64)) continue;
      const holder = element('div', 'output-img');
      const img = element('img');
      img.alt = get('text/plain') || mime;
      img.loading = 'lazy';
      img.src = `data:${mime};base64,${base64}`;
      holder.append(img);
      return holder;
    }
    if ((value = get('text/markdown')) !== null) {
      // Rendered by Debian's marked (view/static/marked.js) into the same sandboxed frame as HTML: whatever
      // HTML the Markdown carries is as contained as an HTML output. Without marked, the text as it is.
      const markdown = window.marked && typeof window.marked.parse === 'function'
        ? window.marked.parse(value) : `<pre style="white-space:pre-wrap">${escapeHtml(value)}</pre>`;
      return framedOutput(markdown);
    }
    if ((value = get('application/json')) !== null) return element('pre', 'output-json', value);
    const pre = element('pre', 'output-text');
    appendAnsi(pre, get('text/plain') ?? '');
    return pre;
  }

  // ------------------------------------------------------------------------------------- the session page
  function sessionPage() {
    const cellsNode = $('#cells');
    const followButton = $('#follow');
    const sessionId = decodeURIComponent(location.pathname.split('/').slice(-2, -1)[0] || '');
    $('#title').textContent = `session ${sessionId}`;
    document.title = `cellblock · ${sessionId}`;
    const cells = new Map();  // cell number -> its parts
    let loose = null;         // approvals outside any cell
    let following = true;

    function formatDuration(ms) {
      if (typeof ms !== 'number') return '';
      return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
    }
    function newCell(number, code, executionCount, running) {
      const old = cells.get(number);
      if (old) old.node.remove();
      const node = element('section', `cell ${running ? 'running' : ''}`);
      node.dataset.cell = String(number);
      const head = element('div', 'cell-head');
      const count = element('span', 'count', executionCount == null ? '[ ]' : `[${executionCount}]`);
      const duration = element('span', 'duration');
      const outcome = element('span', 'outcome', running ? 'running' : '');
      head.append(count, duration, outcome);
      const codeNode = element('pre', 'code', code);
      const outputs = element('div', 'outputs');
      node.append(head, codeNode, outputs);
      cellsNode.append(node);
      const cell = { node, count, duration, outcome, outputs, lastStream: null, liveError: null, approvals: new Map() };
      cells.set(number, cell);
      return cell;
    }
    function cellFor(number) { return cells.get(number) || newCell(number, '', null, false); }
    function appendStream(cell, name, text) {
      if (!cell.lastStream || cell.lastStream.name !== name || cell.lastStream.pre.parentNode !== cell.outputs ||
          cell.outputs.lastChild !== cell.lastStream.pre) {
        const pre = element('pre', `stream ${name}`);
        cell.outputs.append(pre);
        cell.lastStream = { name, pre };
      }
      appendAnsi(cell.lastStream.pre, text);
    }
    function addNotice(parent, text, extra) {
      parent.append(element('div', `notice ${extra || ''}`, text));
    }
    function setOutcome(cell, status, durationMs, executionCount) {
      cell.node.classList.remove('running', 'ok', 'error', 'timeout');
      cell.node.classList.add(status === 'ok' ? 'ok' : status === 'timeout' ? 'timeout' : 'error');
      cell.outcome.textContent = status || '';
      cell.duration.textContent = formatDuration(durationMs);
      if (executionCount != null) cell.count.textContent = `[${executionCount}]`;
    }
    function renderErrorOutput(cell, ename, evalue, traceback) {
      const pre = element('pre', 'traceback');
      const text = joined(Array.isArray(traceback) ? traceback.join('\n') : traceback) || `${ename}: ${evalue}`;
      renderTraceback(pre, text);
      cell.outputs.append(pre);
      return pre;
    }
    function renderApproval(cell, event) {
      const parent = cell ? cell.outputs : (loose || (loose = cellsNode.insertBefore(element('div', 'loose'), cellsNode.firstChild)));
      const approvals = cell ? cell.approvals : (parent.approvals || (parent.approvals = new Map()));
      let node = approvals.get(event.id);
      if (!node) { node = element('div', 'approval'); parent.append(node); approvals.set(event.id, node); }
      const target = `${event.method || 'CONNECT'} ${event.host}:${event.port}`;
      if (event.state === 'decided') {
        const allowed = /^allow/.test(event.decision || '');
        node.className = `approval decided ${allowed ? 'allowed' : 'denied'}`;
        node.textContent = `network request ${target}: ${event.decision}${event.decided_by ? ` (by ${event.decided_by})` : ''}`;
      } else {
        node.className = 'approval pending';
        node.textContent = `network request ${target} waits for approval (id ${event.id}, ${event.timeout_s ?? '?'} s)`;
      }
    }
    function finishCell(cell, event) {
      if (event.relayed_whole === false) {
        // What was relayed live stops at the cap; the end has the head and tail of the whole.
        for (const pre of cell.outputs.querySelectorAll('.stream')) pre.remove();
        cell.lastStream = null;
        if (event.stdout) appendStream(cell, 'stdout', event.stdout);
        if (event.stderr) appendStream(cell, 'stderr', event.stderr);
      }
      if (event.error && typeof event.error === 'object') {
        const pre = renderErrorOutput(cell, event.error.ename, event.error.evalue, event.error.traceback);
        if (cell.liveError) { cell.liveError.replaceWith(pre); cell.liveError = null; }
      }
      if (event.saved && typeof event.saved === 'object') {
        const names = Object.entries(event.saved).map(([kind, path]) => `${kind}: ${path}`).join(', ');
        cell.outputs.append(element('div', 'saved', `whole output saved in the workspace (${names})`));
      }
      if (event.state_lost) addNotice(cell.outputs, event.notice || 'the kernel state was lost', 'state-lost');
      else if (event.notice) addNotice(cell.outputs, event.notice);
      setOutcome(cell, event.status, event.duration_ms, event.execution_count);
    }
    function handle(event) {
      const number = event.cell;
      switch (event.type) {
        case 'recorded': {
          const cell = newCell(number, joined(event.source), event.execution_count, false);
          let failed = false;
          for (const output of event.outputs || []) {
            if (output.output_type === 'stream') appendStream(cell, output.name === 'stderr' ? 'stderr' : 'stdout', joined(output.text));
            else if (output.output_type === 'error') { failed = true; renderErrorOutput(cell, output.ename, output.evalue, output.traceback); }
            else cell.outputs.append(renderBundle(output.data));
          }
          const meta = (event.metadata && event.metadata.cellblock) || {};
          if (meta.lost) addNotice(cell.outputs, 'the kernel running this cell was lost', 'state-lost');
          setOutcome(cell, meta.status || (failed ? 'error' : 'ok'), meta.duration_ms, event.execution_count);
          break;
        }
        case 'cell': newCell(number, event.code, null, true); break;
        case 'stdout': case 'stderr': appendStream(cellFor(number), event.type, event.text || ''); break;
        case 'result': case 'display': cellFor(number).outputs.append(renderBundle(event.data)); break;
        case 'error': {
          const cell = cellFor(number);
          cell.liveError = element('pre', 'traceback');
          renderTraceback(cell.liveError, `${event.ename}: ${event.evalue}`);
          cell.outputs.append(cell.liveError);
          break;
        }
        case 'approval': renderApproval(number >= 0 ? cells.get(number) : null, event); break;
        case 'notice': addNotice(number >= 0 ? cellFor(number).outputs : cellsNode, event.text || ''); break;
        case 'end': finishCell(cellFor(number), event); break;
        case 'reset':
          cells.clear();
          loose = null;
          cellsNode.replaceChildren();
          addNotice(cellsNode, 'the session was reset: a new kernel, the cells before are gone', 'state-lost');
          break;
        case 'resync':
          // The gateway restarted since this page's last event: the whole session follows from its record.
          cells.clear();
          loose = null;
          cellsNode.replaceChildren();
          break;
        default: break;
      }
    }

    // Events are applied once per animation frame, all that arrived since the last.
    let pending = [];
    let scheduled = false;
    function flush() {
      scheduled = false;
      const batch = pending;
      pending = [];
      for (const event of batch) {
        try { handle(event); } catch (error) { console.error('cellblock view: event', event.type, error); }
      }
      document.body.dataset.lastEventId = String(lastId);
      if (following) window.scrollTo(0, document.documentElement.scrollHeight);
    }
    function schedule() {
      if (scheduled) return;
      scheduled = true;
      requestAnimationFrame(flush);
    }
    // A reader who scrolls up stays where they are; back at the bottom (or the button) it follows again.
    let lastScroll = 0;
    addEventListener('scroll', () => {
      const atBottom = window.scrollY + window.innerHeight >= document.documentElement.scrollHeight - 40;
      if (atBottom) following = true;
      else if (window.scrollY < lastScroll) following = false;
      lastScroll = window.scrollY;
      followButton.hidden = following;
    }, { passive: true });
    followButton.addEventListener('click', () => {
      following = true;
      followButton.hidden = true;
      window.scrollTo(0, document.documentElement.scrollHeight);
    });

    // The stream: EventSource reconnects by itself with Last-Event-ID; when it gives up (an error answer),
    // a new one resumes with ?last_event_id=. An id seen before is never applied twice.
    let lastId = 0;
    let retryMs = 1000;
    // A browser keeps at most six HTTP/1.1 connections to one gateway, and each open page's stream holds one:
    // a page in a hidden tab lets its stream go and resumes from its last id when shown again, so a reader
    // with many sessions open in tabs is not left with pages that never load.
    let source = null;
    let retryTimer = null;
    document.addEventListener('visibilitychange', () => {
      if (document.visibilityState === 'hidden') {
        clearTimeout(retryTimer);
        if (source) source.close();
        source = null;
        setConnection('paused while hidden', 'down');
      } else if (!source) {
        clearTimeout(retryTimer);
        connect();
      }
    });
    function connect() {
      if (document.visibilityState === 'hidden' || source) return;
      source = new EventSource(lastId ? `events?last_event_id=${lastId}` : 'events');
      const current = source;
      source.onopen = () => { retryMs = 1000; setConnection('live', 'live'); };
      source.onmessage = (message) => {
        const id = Number(message.lastEventId);
        let event;
        try { event = JSON.parse(message.data); } catch { return; }
        // A resync starts the page over whatever its id (another gateway's clock may lag this one's).
        if (event.type === 'resync') pending = [];
        else if (id && id <= lastId) return;
        if (id) lastId = id;
        pending.push(event);
        schedule();
      };
      source.onerror = () => {
        if (current !== source) return;  // closed while hidden
        setConnection('reconnecting…', 'down');
        if (current.readyState === EventSource.CLOSED) {
          source = null;
          retryTimer = setTimeout(connect, retryMs);
          retryMs = Math.min(retryMs * 2, 15000);
        }
      };
    }
    connect();
  }

  // ---------------------------------------------------------------------------------------- the list page
  function listPage() {
    const body = $('#sessions tbody');
    async function poll() {
      try {
        const response = await fetch('view/sessions', { cache: 'no-store', credentials: 'same-origin' });
        if (response.status === 401) {
          setConnection('the cookie expired: open this page with ?token= again', 'down');
          return;
        }
        const { sessions } = await response.json();
        const rows = sessions.map((session) => {
          const row = element('tr');
          const link = element('a', '', session.name || session.id);
          link.href = `view/open/${encodeURIComponent(session.id)}`;
          const name = element('td');
          name.append(link);
          const state = session.state === 'busy' ? 'running' : session.state;
          row.append(name, element('td', `state-${session.state.replace(/\W/g, '-')}`, state),
            element('td', '', String(session.queued ?? 0)), element('td', '', String(session.cells ?? 0)),
            element('td', '', session.created || ''));
          return row;
        });
        body.replaceChildren(...rows);
        $('#empty').hidden = sessions.length > 0;
        setConnection('live', 'live');
      } catch (error) {
        setConnection('gateway unreachable, retrying', 'down');
      }
      setTimeout(poll, 1000);
    }
    poll();
  }

  if (document.body.dataset.page === 'session') sessionPage();
  else if (document.body.dataset.page === 'list') listPage();
})();
