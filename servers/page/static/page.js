// The operator's page: snapshots pushed by the server (presence/stream), or polled
// (presence.json) where a proxy cuts the stream. Every URL is relative, so the page
// works under whatever path prefix a reverse proxy gives it.
"use strict";

const POLL_EVERY = 1000;   // ms between polls when the stream is not there: as often as it would push
const STREAM_TRIES = 3;    // failed stream openings before the page polls instead
const RATE_POINTS = 120;   // seconds of event rate kept for the chart

const $ = (id) => document.getElementById(id);
const fmt = new Intl.NumberFormat();
let latest = null;          // the last snapshot, whichever way it came
let lastRegistry = null;    // the registry part of the last snapshot that had one
let searchResults = null;   // the registry part of the last search answer, while searching
let streamFailures = 0;
let source = null;
let pollTimer = null;
let searchTimer = null;
const rates = { labels: [], online: [], offline: [] };

function n(value) { return value === null || value === undefined ? "–" : fmt.format(value); }
function clock(unix) { return unix ? new Date(unix * 1000).toLocaleTimeString() : "–"; }
function seconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 120) return `${s.toFixed(1)} s`;
  if (s < 7200) return `${(s / 60).toFixed(1)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}
function bytes(b) { return `${(b / 1048576).toFixed(1)} MiB`; }
function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  if (cls) node.className = cls;
  return node;
}

function setMode(mode, text) {
  const badge = $("mode");
  badge.className = `badge ${mode}`;
  badge.textContent = text;
}

// -- getting snapshots ------------------------------------------------------------

function openStream() {
  if (!window.EventSource) { startPolling(); return; }
  source = new EventSource("presence/stream");
  source.addEventListener("snapshot", (message) => {
    streamFailures = 0;
    setMode("stream", "live");
    show(JSON.parse(message.data));
  });
  source.onerror = () => {
    streamFailures += 1;
    // CLOSED: the answer was not a stream at all (a proxy's 502, the server's 503 at its
    // bound), and the browser will not try again; CONNECTING: cut, and it tries again.
    if (source.readyState === EventSource.CLOSED || streamFailures >= STREAM_TRIES) {
      source.close();
      source = null;
      startPolling();
    } else {
      setMode("down", "reconnecting");
    }
  };
}

function startPolling() {
  if (pollTimer) return;
  setMode("poll", "polling");
  const poll = async () => {
    try {
      const answer = await fetch("presence.json", { cache: "no-store" });
      if (!answer.ok) throw new Error(answer.status);
      setMode("poll", "polling");
      show(await answer.json());
    } catch (err) {
      setMode("down", "not answering");
    }
  };
  poll();
  pollTimer = setInterval(poll, POLL_EVERY);
}

async function search() {
  const query = $("search").value.trim();
  if (!query) { searchResults = null; render(); return; }
  try {
    const answer = await fetch(`presence.json?q=${encodeURIComponent(query)}&limit=200`, { cache: "no-store" });
    if (!answer.ok) return;
    const found = await answer.json();
    // A registry that did not answer this time leaves the last answer up (marked stale).
    if ($("search").value.trim() === query && found.registry) { searchResults = found.registry; render(); }
  } catch (err) { /* the next keystroke or refresh asks again */ }
}

$("search").addEventListener("input", () => {
  clearTimeout(searchTimer);
  searchTimer = setTimeout(search, 250);
});

// -- showing them -----------------------------------------------------------------

function show(snapshot) {
  latest = snapshot;
  const registry = snapshot.registry;
  if (registry && registry.rate) {
    rates.labels.push(clock(snapshot.time));
    rates.online.push(registry.rate.online_per_s);
    rates.offline.push(registry.rate.offline_per_s);
    for (const list of [rates.labels, rates.online, rates.offline]) {
      if (list.length > RATE_POINTS) list.shift();
    }
  }
  if ($("search").value.trim()) search();
  render();
}

function render() {
  const snapshot = latest;
  if (!snapshot) return;
  if (snapshot.registry) lastRegistry = snapshot.registry;
  const registry = snapshot.registry;
  $("as-of").textContent = `as of ${clock(registry ? registry.as_of : snapshot.time)}`;
  renderScope(snapshot);
  renderCounts(registry);
  renderRecent(searchResults || lastRegistry, !registry);
  renderLateness(snapshot);
  renderRates();
  renderWorkers(snapshot.workers, snapshot.tick);
  renderListeners(snapshot.listeners || []);
}

function renderListeners(listeners) {
  const body = $("listeners-body");
  body.replaceChildren();
  for (const l of listeners) {
    const row = el("tr");
    row.dataset.listener = l.name;
    row.append(el("td", l.name), el("td", n(l.online)), el("td", n(l.accepted)), el("td", n(l.refused)));
    body.append(row);
  }
}

function renderScope(snapshot) {
  const registry = snapshot.registry;
  const scope = registry ? registry.scope : "registry not answering";
  const names = { worker: "one worker", box: "this box (the supervisor's registry)", fleet: "the fleet (Redis)" };
  let text = `${names[scope] || scope} · ${snapshot.workers.length} worker${snapshot.workers.length === 1 ? "" : "s"} here`;
  const node = snapshot.workers.find((w) => w.node);
  if (node) text += ` · node ${node.node}`;
  if (registry && registry.nodes) text += ` · ${registry.nodes.length} nodes`;
  $("scope").textContent = text;
}

function renderCounts(registry) {
  if (!registry) {
    const when = lastRegistry ? ` at ${clock(lastRegistry.as_of)}` : "";
    $("counts-note").textContent = `The registry did not answer in time; counts and list are from its last answer${when}.`;
    return;
  }
  $("online-count").textContent = n(registry.online);
  $("offline-count").textContent = registry.records === null ? "–" : n(registry.records - registry.online);
  $("takeover-count").textContent = n(registry.ends.takeover || 0);
  $("sessions-count").textContent = n(registry.sessions);
  $("event-rate").textContent = `${registry.rate.online_per_s.toFixed(1)} / ${registry.rate.offline_per_s.toFixed(1)}`;
  const ends = Object.entries(registry.ends).sort((a, b) => b[1] - a[1]).map(([r, c]) => `${r} ${n(c)}`);
  $("counts-note").textContent =
    `Online ${registry.scope === "fleet" ? "counted in Redis" : "from the registry"} at ${clock(registry.as_of)}. ` +
    `Ended since ${clock(registry.since)}: ${ends.length ? ends.join(", ") : "none"}.`;
}

let shownRecent = null;  // what the list shows now: rebuilt only when that changes

function renderRecent(part, stale) {
  const body = $("recent-body");
  const entries = part ? part.recent : [];
  // Rows are replaced only when the list changed: a link being clicked stays put.
  const key = part ? entries.map((e) => `${e.epoch}|${e.client_id}`).join("\n") : "-";
  if (key !== shownRecent) {
    shownRecent = key;
    fillRecent(body, part, entries);
  }
  const query = $("search").value.trim();
  $("recent-note").textContent = part
    ? `${query ? `Matching "${query}": ` : ""}${entries.length} shown, newest first, of the last ${n(part.recent_kept)} kept` +
      (stale ? ` (as of ${clock(part.as_of)}: the registry did not answer since).` : ".")
    : "";
}

function fillRecent(body, part, entries) {
  body.replaceChildren();
  if (!entries.length) {
    const row = el("tr");
    const cell = el("td", part ? "none" : "the registry did not answer", "muted");
    cell.colSpan = 7;
    row.append(cell);
    body.append(row);
  }
  for (const e of entries) {
    const row = el("tr");
    row.dataset.clientId = e.client_id;
    row.dataset.reason = e.reason;
    const id = el("td", undefined, "id");
    const link = el("a", e.client_id);
    link.href = `devices/${encodeURIComponent(e.client_id)}`;
    id.append(link);
    row.append(
      id,
      el("td", e.reason + (e.detail ? ` (${e.detail})` : ""), `reason-${e.reason}`),
      el("td", e.initiator),
      el("td", clock(e.time)),
      el("td", clock(e.last_seen)),
      el("td", seconds(e.silent_for)),
      el("td", e.node ? `${e.node}` : `worker ${e.worker}`),
    );
    body.append(row);
  }
}

// -- charts -----------------------------------------------------------------------

let latenessChart = null;
let rateChart = null;

// Draws the tick, the promise, as a dashed line between the buckets on time and late.
const tickLine = {
  id: "tickLine",
  afterDraw(chart, args, options) {
    if (options.at === undefined || options.at < 0) return;
    const x = chart.scales.x;
    const left = x.getPixelForValue(options.at);
    const right = x.getPixelForValue(options.at + 1);
    const where = (left + right) / 2;
    const { ctx, chartArea } = chart;
    ctx.save();
    ctx.strokeStyle = "#b3261e";
    ctx.setLineDash([5, 4]);
    ctx.beginPath();
    ctx.moveTo(where, chartArea.top);
    ctx.lineTo(where, chartArea.bottom);
    ctx.stroke();
    ctx.fillStyle = "#b3261e";
    ctx.fillText("one tick", where + 4, chartArea.top + 10);
    ctx.restore();
  },
};

function quantile(bounds, counts, total, q) {
  if (!total) return null;
  let running = 0;
  for (let i = 0; i < counts.length; i++) {
    running += counts[i];
    if (running >= q * total) return i < bounds.length ? bounds[i] : Infinity;
  }
  return Infinity;
}

function renderLateness(snapshot) {
  const h = snapshot.lateness;
  const tick = snapshot.tick;
  const labels = h.bounds.map((b) => `≤ ${seconds(b)}`).concat([`> ${seconds(h.bounds[h.bounds.length - 1] || 0)}`]);
  const tickIndex = h.bounds.findIndex((b) => Math.abs(b - tick) < 1e-9);
  const colours = h.counts.map((_, i) => (i <= tickIndex ? "#1b7f3b" : "#b3261e"));
  if (window.Chart && !latenessChart) {
    latenessChart = new Chart($("lateness-chart"), {
      type: "bar",
      data: { labels, datasets: [{ label: "devices declared dead", data: h.counts, backgroundColor: colours }] },
      options: { animation: false, plugins: { legend: { display: false }, tickLine: { at: tickIndex } } },
      plugins: [tickLine],
    });
  } else if (latenessChart) {
    latenessChart.data.labels = labels;
    latenessChart.data.datasets[0].data = h.counts;
    latenessChart.data.datasets[0].backgroundColor = colours;
    latenessChart.options.plugins.tickLine.at = tickIndex;
    latenessChart.update("none");
  }
  const onTime = h.counts.slice(0, tickIndex + 1).reduce((a, b) => a + b, 0);
  const p99 = quantile(h.bounds, h.counts, h.count, 0.99);
  $("lateness-p99").textContent = h.count ? `≤ ${seconds(p99)}` : "–";
  $("lateness-note").textContent = h.count
    ? `${n(h.count)} keep-alive timeouts; ${n(onTime)} (${((100 * onTime) / h.count).toFixed(1)} %) within one tick ` +
      `(${seconds(tick)}); the latest ${seconds(h.max)} late.`
    : `No keep-alive timeout yet. The tick is ${seconds(tick)}.`;
}

function renderRates() {
  if (!window.Chart) return;
  if (!rateChart) {
    rateChart = new Chart($("rate-chart"), {
      type: "line",
      data: {
        labels: rates.labels,
        datasets: [
          { label: "online / s", data: rates.online, borderColor: "#1b7f3b", pointRadius: 0, tension: 0.2 },
          { label: "offline / s", data: rates.offline, borderColor: "#b3261e", pointRadius: 0, tension: 0.2 },
        ],
      },
      options: { animation: false, scales: { y: { beginAtZero: true } } },
    });
  } else {
    rateChart.update("none");
  }
}

function renderWorkers(workers, tick) {
  const body = $("workers-body");
  body.replaceChildren();
  for (const w of workers) {
    const row = el("tr");
    if (w.answering === false) {
      const cell = el("td", `status port ${w.status_port}: not answering`, "muted");
      cell.colSpan = 9;
      row.append(cell);
    } else {
      const lag = w.reaper_lag;
      row.dataset.worker = w.worker;
      row.append(
        el("td", `${w.worker}`),
        el("td", `${w.pid}`),
        el("td", n(w.connections)),
        el("td", n(w.online)),
        el("td", n(w.packets_per_s)),
        el("td", `${(100 * w.cpu).toFixed(1)} %`),
        el("td", bytes(w.rss_bytes)),
        el("td", lag.count ? `${seconds(lag.p50)} / ${seconds(lag.p99)} / ${seconds(lag.max)}` : "–"),
        el("td", seconds(w.up_for)),
      );
      if (lag.count && lag.p99 > tick) row.className = "reason-keepalive-timeout";
    }
    body.append(row);
  }
}

openStream();
