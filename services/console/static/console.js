// The console's own script (no framework): confirmation dialogs for
// mutating forms, and live updates from the events stream
// (/console/events/stream, the API's events watch as the signed-in
// identity) patched into the page.
(function () {
  'use strict';

  // readyAttr maps a Ready condition's value (True, Unknown, Lost) to a
  // tile's data-ready (True, False, Unknown), as the server does.
  function readyAttr(v) {
    if (v === 'True') { return 'True'; }
    if (v === 'Unknown' || !v) { return 'Unknown'; }
    return 'False';
  }

  // Confirmation: a form with data-confirm first opens #confirm-dialog;
  // Confirm submits it, Cancel leaves it.
  var dialog = document.getElementById('confirm-dialog');
  var pending = null;
  document.addEventListener('submit', function (ev) {
    var form = ev.target;
    if (!form || !form.dataset || !form.dataset.confirm || !dialog || typeof dialog.showModal !== 'function') {
      return;
    }
    ev.preventDefault();
    pending = form;
    var text = form.dataset.confirm;
    var kind = form.querySelector('select[name="kind"]');
    if (kind) { text = text.replace('{kind}', kind.value); }
    document.getElementById('confirm-text').textContent = text;
    dialog.showModal();
  }, true);
  if (dialog) {
    document.getElementById('confirm-yes').addEventListener('click', function () {
      var form = pending;
      pending = null;
      dialog.close();
      if (form) { HTMLFormElement.prototype.submit.call(form); }
    });
    document.getElementById('confirm-no').addEventListener('click', function () {
      pending = null;
      dialog.close();
    });
  }

  function text(tag, cls, s) {
    var el = document.createElement(tag);
    if (cls) { el.className = cls; }
    el.textContent = s;
    return el;
  }

  function eventItem(e) {
    var li = document.createElement('li');
    li.dataset.eventType = e.type || '';
    li.dataset.subject = e.subject || '';
    li.dataset.cursor = e.cursor || '';
    li.className = 'live';
    li.appendChild(text('time', '', e.time || ''));
    li.appendChild(document.createTextNode(' '));
    li.appendChild(text('strong', '', e.type || ''));
    li.appendChild(document.createTextNode(' '));
    li.appendChild(text('span', 'subject', e.subject || ''));
    li.appendChild(document.createTextNode(' '));
    var data = JSON.stringify(e.data || {});
    li.appendChild(text('code', '', data.length > 300 ? data.slice(0, 300) + '…' : data));
    return li;
  }

  var seen = {};
  var seenCount = 0;
  function prepend(list, e) {
    if (e.cursor && list.querySelector('li[data-cursor="' + CSS.escape(e.cursor) + '"]')) { return; }
    list.insertBefore(eventItem(e), list.firstChild);
    while (list.children.length > 500) { list.removeChild(list.lastChild); }
  }

  function apply(e) {
    var type = e.type || '';
    var subject = e.subject || '';
    var data = e.data || {};
    if (e.cursor) {
      if (seen[e.cursor]) { return; }
      if (++seenCount > 10000) { seen = {}; seenCount = 0; }
      seen[e.cursor] = true;
    }
    if (type === 'node.ready' || type === 'node.not_ready' || type === 'node.lost') {
      var node = data.nodeId || subject;
      var to = data.to || (type === 'node.ready' ? 'True' : type === 'node.lost' ? 'Lost' : 'Unknown');
      document.querySelectorAll('.tile[data-node-id="' + CSS.escape(node) + '"]').forEach(function (tile) {
        tile.dataset.ready = readyAttr(to);
        var label = tile.querySelector('.ready');
        if (label) { label.textContent = to; }
      });
      var nr = document.getElementById('node-ready');
      if (nr && nr.dataset.nodeId === node) {
        nr.textContent = readyAttr(to);
        nr.dataset.value = to;
      }
    }
    if (type.indexOf('command.') === 0) {
      var cmd = data.command || {};
      var id = data.commandId || cmd.id || subject;
      var state = type === 'command.requested' || type === 'command.cancel_requested' ? '' : (data.state || type.slice('command.'.length));
      if (state) {
        var cs = document.getElementById('command-state');
        if (cs && cs.dataset.commandId === id) {
          cs.textContent = state.toUpperCase();
          cs.dataset.state = state;
        }
        document.querySelectorAll('tr[data-command-id="' + CSS.escape(id) + '"]').forEach(function (row) {
          row.dataset.state = state;
          var cell = row.querySelector('.state');
          if (cell) { cell.textContent = state.toUpperCase(); }
        });
      }
    }
    if (type.indexOf('reservation.') === 0 && data.reservation && data.reservation.state) {
      document.querySelectorAll('tr[data-reservation-id="' + CSS.escape(data.reservation.id || subject) + '"]').forEach(function (row) {
        row.dataset.state = data.reservation.state;
      });
    }
    var list = document.getElementById('event-list');
    if (list) { prepend(list, e); }
    var nodeEvents = document.getElementById('node-events');
    var nodeReady = document.getElementById('node-ready');
    if (nodeEvents && nodeReady && subject === nodeReady.dataset.nodeId) { prepend(nodeEvents, e); }
  }

  var src = document.body && document.body.dataset.stream;
  if (src && window.EventSource) {
    var es = new EventSource(src);
    es.onmessage = function (m) {
      var e;
      try { e = JSON.parse(m.data); } catch (err) { return; }
      apply(e);
    };
    es.onerror = function (ev) {
      // A stream the server ended on purpose sends `event: error` with the
      // error envelope: reconnect only when the code says retrying helps
      // (UNAVAILABLE: its lifetime ended; resumes by Last-Event-ID).
      var env = null;
      if (ev && typeof ev.data === 'string') {
        try { env = JSON.parse(ev.data); } catch (err) { env = null; }
      }
      if (env && env.code && env.code !== 'UNAVAILABLE') {
        es.close();
        document.body.dataset.streamState = 'closed';
        document.body.dataset.streamError = env.code;
        return;
      }
      document.body.dataset.streamState = es.readyState === EventSource.CLOSED ? 'closed' : 'reconnecting';
    };
    es.onopen = function () { document.body.dataset.streamState = 'open'; };
  }
}());
