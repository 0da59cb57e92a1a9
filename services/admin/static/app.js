// The status page of `sluice admin serve`: polls api/status every 2 s and redraws tables and charts.
// No framework and no build step; data only ever reaches the DOM as text (textContent), never as HTML.
"use strict";

const POLL_MS = 2000;
const TOKEN_KEY = "sluice-admin-token";
const SVG_NS = "http://www.w3.org/2000/svg";
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

let lastData = null;
let inFlight = false;

// --- the token: asked once, kept in this tab's sessionStorage --------------------------

function takeTokenFromFragment() {
  // #token=... lets a script open the page already signed in; the fragment never reaches
  // the server, and it is dropped from the address bar at once.
  const match = /^#token=(.+)$/.exec(location.hash);
  if (match) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
}

function authHeaders() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? { Authorization: "Bearer " + token } : {};
}

function askForToken(problem) {
  document.getElementById("token-panel").hidden = false;
  document.getElementById("content").hidden = true;
  document.getElementById("token-problem").textContent = problem || "";
  document.getElementById("status-line").textContent = "a bearer token is required";
}

document.addEventListener("DOMContentLoaded", () => {
  takeTokenFromFragment();
  document.getElementById("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const value = document.getElementById("token-input").value.trim();
    if (value) {
      sessionStorage.setItem(TOKEN_KEY, value);
      document.getElementById("token-input").value = "";
      poll();
    }
  });
  poll();
  setInterval(poll, POLL_MS);
});

// --- polling ------------------------------------------------------------------------------

async function poll() {
  if (inFlight) return;
  inFlight = true;
  try {
    const response = await fetch("api/status", { headers: authHeaders(), cache: "no-store" });
    if (response.status === 401) {
      const had = sessionStorage.getItem(TOKEN_KEY);
      sessionStorage.removeItem(TOKEN_KEY);
      askForToken(had ? "that token was refused" : "");
      return;
    }
    if (!response.ok) throw new Error("api/status answered " + response.status);
    const data = await response.json();
    document.getElementById("token-panel").hidden = true;
    document.getElementById("content").hidden = false;
    lastData = data;
    render(data);
  } catch (err) {
    showBanner("The page's server does not answer (" + err.message + "); showing the last data received.");
  } finally {
    inFlight = false;
  }
}

function showBanner(text) {
  const banner = document.getElementById("error-banner");
  banner.hidden = !text;
  banner.textContent = text || "";
}

// --- formatting ---------------------------------------------------------------------------

function fmtAge(s) {
  if (s === null || s === undefined) return "—";
  if (s < 60) return s.toFixed(1) + " s";
  if (s < 3600) return Math.floor(s / 60) + "m " + String(Math.floor(s % 60)).padStart(2, "0") + "s";
  return Math.floor(s / 3600) + "h " + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + "m";
}

function fmtRate(v) {
  if (v === null || v === undefined) return "—";
  return v < 9.95 ? v.toFixed(1) : Math.round(v).toLocaleString("en");
}

function fmtAgo(s) {
  return s === null || s === undefined ? "—" : fmtAge(s) + " ago";
}

function yesNo(v) {
  return v === null || v === undefined ? "—" : v ? "yes" : "no";
}

function fmtCount(v) {
  return v === null || v === undefined ? "—" : Number(v).toLocaleString("en");
}

function fmtDateTime(ms) {
  return ms ? new Date(ms).toLocaleString("en-GB") : "—";
}

function fmtClock(ms) {
  return ms ? new Date(ms).toLocaleTimeString("en-GB") : "—";
}

function stateClass(state) {
  if (state === "running") return "state-running";
  if (state === "paused") return "state-paused";
  if (state === "stopped") return "state-stopped";
  if (state === "stale report") return "state-stale";
  return "state-none";
}

// --- tables -------------------------------------------------------------------------------

// columns: [{title, value(row) -> string | Node, num?: bool, cls?(row) -> string, wrap?: bool}]
// rowAttrs(row) -> {attr: value} puts data-* attributes on each <tr> (tests and styling read them).
function fillTable(table, columns, rows, rowAttrs, emptyText) {
  if (!table.tHead) {
    const head = table.createTHead().insertRow();
    for (const col of columns) {
      const th = document.createElement("th");
      th.textContent = col.title;
      if (col.num) th.className = "num";
      head.appendChild(th);
    }
  }
  const body = document.createElement("tbody");
  for (const row of rows) {
    const tr = body.insertRow();
    for (const [name, value] of Object.entries(rowAttrs ? rowAttrs(row) : {})) tr.setAttribute(name, value);
    for (const col of columns) {
      const td = tr.insertCell();
      const value = col.value(row);
      if (value instanceof Node) td.appendChild(value); else td.textContent = value;
      const classes = [col.num ? "num" : "", col.wrap ? "wrap" : "", col.cls ? col.cls(row) : ""];
      td.className = classes.filter(Boolean).join(" ");
    }
  }
  if (!rows.length) {
    const tr = body.insertRow();
    tr.className = "empty";
    const td = tr.insertCell();
    td.colSpan = columns.length;
    td.textContent = emptyText || "none";
  }
  for (const old of Array.from(table.tBodies)) old.remove();
  table.appendChild(body);
}

function queueColour(ids, id) {
  return PALETTE[ids.indexOf(id) % PALETTE.length];
}

function render(data) {
  document.getElementById("site-name").textContent = data.site.name;
  document.getElementById("site-dsid").textContent = data.site.dsid;
  document.title = "Sluice status: site " + data.site.name;
  const took = data.sample_s !== undefined ? " (took " + data.sample_s.toFixed(2) + " s)" : "";
  document.getElementById("status-line").textContent =
    (data.sampled_at_ms ? "sampled " + fmtClock(data.sampled_at_ms) + took : "waiting for the first sample") +
    ", every " + data.interval_s + " s; Kafka at " + data.site.bootstrap +
    (data.token_required ? "; token required" : "");
  if (data.error) {
    const since = data.stale_since_ms ? " since " + fmtClock(data.stale_since_ms) : "";
    showBanner("Cannot sample the site" + since + ": " + data.error +
               (data.sampled_at_ms ? ". The tables show the last good sample." : ""));
  } else {
    showBanner("");
  }
  const ids = data.queues.map((q) => q.id);
  // Before the first sample every table is empty for that reason, not because the site has nothing.
  const none = (text) => data.sampled_at_ms ? text : "waiting for the first sample";

  fillTable(document.getElementById("sites-table"), [
    { title: "dsid", value: (s) => String(s.dsid), num: true },
    { title: "site", value: (s) => s.name || "—" },
    { title: "role", value: (s) => s.role },
    { title: "Kafka", value: (s) => s.bootstrap || "—" },
    { title: "senders to it", value: (s) => s.senders.join(", ") || "—" },
    { title: "queued for it", value: (s) => fmtCount(s.queued), num: true },
    { title: "events out/s", value: (s) => fmtRate(s.out_per_s), num: true },
    { title: "receiver accepts", value: (s) => yesNo(s.accepted_by_receiver) },
  ], data.sites, (s) => ({ "data-dsid": s.dsid }), none("none"));

  // A region's standby copies: how many buckets have all their redundant_copies, the worst lag (changelog
  // offsets), and the value bytes the copies hold; each bucket's copies are in /api/status.
  function standbyText(r) {
    if (!r.redundant_copies) return "none configured";
    if (r.standbys === null) return "unknown";
    const full = r.standbys.filter((c) => c.length >= r.redundant_copies).length;
    const lags = r.standbys.flat().map((c) => c.lag).filter((l) => l >= 0);
    const bytes = r.standbys.flat().reduce((sum, c) => sum + c.value_bytes, 0);
    return full + "/" + r.buckets + " buckets with " + r.redundant_copies + " copies" +
      (lags.length ? ", worst lag " + fmtCount(Math.max(...lags)) : "") + ", " + fmtCount(bytes) + " value bytes";
  }

  fillTable(document.getElementById("regions-table"), [
    { title: "region", value: (r) => r.name },
    { title: "buckets", value: (r) => String(r.buckets), num: true },
    { title: "owned", value: (r) => r.buckets_owned === null ? "—" : String(r.buckets_owned), num: true,
      cls: (r) => r.buckets_owned !== null && r.buckets_owned < r.buckets ? "bad" : "" },
    { title: "region service instances (buckets)", wrap: true,
      value: (r) => r.instances === null ? "unknown (the broker lists no group members)"
        : r.instances.map((i) => i.instance + " (" + i.buckets + ")").join(", ") || "none" },
    { title: "standby copies (buckets with k of k, worst lag)", wrap: true,
      value: (r) => standbyText(r),
      cls: (r) => r.redundant_copies && r.standbys !== null && r.standbys.some((c) => c.length < r.redundant_copies)
        ? "bad" : "" },
    { title: "senders", value: (r) => r.gateway_senders.join(", ") || "—" },
    { title: "async event queues", value: (r) => r.async_event_queues.join(", ") || "—" },
  ], data.regions, (r) => ({ "data-region": r.name }), none("none"));

  fillTable(document.getElementById("queues-table"), [
    { title: "queue", value: (q) => swatch(queueColour(ids, q.id), q.id) },
    { title: "kind",
      value: (q) => q.kind === "gateway-sender" ? "gateway sender → dsid " + q.remote_dsid : "async event queue" },
    { title: "mode", value: (q) => (q.parallel ? "parallel" : "serial") + ", " + q.partitions.length + " partitions" },
    { title: "regions", value: (q) => q.regions.join(", ") },
    { title: "state", value: (q) => q.states.join(", "),
      cls: (q) => q.states.length === 1 ? stateClass(q.states[0]) : "state-stale" },
    { title: "primaries", value: (q) => String(q.primaries.length), num: true },
    { title: "queue size", value: (q) => (q.size_counted ? "" : "≤") + fmtCount(q.size), num: true },
    { title: "oldest event", value: (q) => fmtAge(q.oldest_age_s), num: true },
    { title: "events in/s", value: (q) => fmtRate(q.in_per_s), num: true },
    { title: "events out/s", value: (q) => fmtRate(q.out_per_s), num: true },
    { title: "resends", value: (q) => fmtCount(q.resends), num: true },
    { title: "last ack", value: (q) => fmtAgo(q.last_ack_age_s), num: true },
    { title: "dead letters", value: (q) => fmtCount(q.dead_lettered), num: true, cls: (q) => q.dead_lettered ? "bad" : "" },
    { title: "actions", value: (q) => actionButtons(data.actions, q) },
  ], data.queues, (q) => ({ "data-queue": q.id, "data-size": q.size }),
  none("no gateway sender or async event queue is attached to a region"));

  const partitions = data.queues.flatMap((q) => q.partitions);
  fillTable(document.getElementById("partitions-table"), [
    { title: "queue", value: (p) => p.queue_id },
    { title: "partition", value: (p) => String(p.partition), num: true },
    { title: "primary", value: (p) => p.primary },
    { title: "state", value: (p) => p.state, cls: (p) => stateClass(p.state) },
    { title: "queue size", value: (p) => (p.size_counted ? "" : "≤") + fmtCount(p.size), num: true },
    { title: "oldest event", value: (p) => fmtAge(p.oldest_age_s), num: true },
    { title: "in flight", value: (p) => String(p.in_flight), num: true },
    { title: "events in/s", value: (p) => fmtRate(p.in_per_s), num: true },
    { title: "events out/s", value: (p) => fmtRate(p.out_per_s), num: true },
    { title: "resends", value: (p) => fmtCount(p.redeliveries), num: true },
    { title: "last ack", value: (p) => fmtAgo(p.last_delivered_age_s), num: true },
    { title: "batches", value: (p) => fmtCount(p.batches), num: true },
    { title: "events delivered", value: (p) => fmtCount(p.events), num: true },
    { title: "dead letters", value: (p) => fmtCount(p.dead_lettered), num: true, cls: (p) => p.dead_lettered ? "bad" : "" },
    { title: "head", value: (p) => fmtCount(p.head), num: true },
    { title: "end", value: (p) => fmtCount(p.end), num: true },
  ], partitions, (p) => ({ "data-queue": p.queue_id, "data-partition": p.partition, "data-size": p.size }),
  none("none"));

  const sectionErrors = data.section_errors || {};
  const cannotRead = (name, otherwise) => sectionErrors[name] ? "cannot read them: " + sectionErrors[name] : otherwise;
  document.getElementById("receivers-section").hidden = data.receivers.length === 0 && !sectionErrors.receivers;
  fillTable(document.getElementById("receivers-table"), [
    { title: "receiver", value: (r) => r.member },
    { title: "state", value: (r) => r.age_s < 30 ? (r.state || "running") : "no report for " + fmtAge(r.age_s),
      cls: (r) => r.age_s < 30 && r.state !== "stopped" ? "state-running" : "state-stale" },
    { title: "partitions", value: (r) => r.partitions.join(",") || "—" },
    { title: "batches", value: (r) => fmtCount(r.batches), num: true },
    { title: "duplicate batches", value: (r) => fmtCount(r.duplicate_batches), num: true },
    { title: "rejected", value: (r) => fmtCount(r.rejected_batches), num: true },
    { title: "bad signatures", value: (r) => fmtCount(r.bad_signatures), num: true },
    { title: "events applied", value: (r) => fmtCount(r.events_applied), num: true },
    { title: "repeats discarded", value: (r) => fmtCount(r.events_duplicate), num: true },
    { title: "conflicts lost", value: (r) => fmtCount(r.conflicts), num: true },
    { title: "refused events", value: (r) => fmtCount(r.exceptions), num: true },
  ], data.receivers, (r) => ({ "data-receiver": r.member }), cannotRead("receivers", none("no receiver has reported")));
  const site = data.receiver_totals;
  const partitionRows = (data.receiver_partitions || []).concat(site ? [{ site: true, totals: site }] : []);
  fillTable(document.getElementById("receiver-partitions-table"), [
    { title: "partition", value: (p) => p.site ? "site" : String(p.partition) },
    { title: "figures by", value: (p) => p.site ? "" : p.member || "—" },
    { title: "taken over from", value: (p) => p.site ? "" : p.carried_from || "—" },
    { title: "batches", value: (p) => fmtCount(p.totals.batches), num: true },
    { title: "duplicate batches", value: (p) => fmtCount(p.totals.duplicate_batches), num: true },
    { title: "rejected", value: (p) => fmtCount(p.totals.rejected_batches), num: true },
    { title: "events applied", value: (p) => fmtCount(p.totals.events_applied), num: true },
    { title: "of them recovered", value: (p) => fmtCount(p.totals.events_recovered), num: true },
    { title: "repeats discarded", value: (p) => fmtCount(p.totals.events_duplicate), num: true },
    { title: "conflicts lost", value: (p) => fmtCount(p.totals.conflicts), num: true },
    { title: "refused events", value: (p) => fmtCount(p.totals.exceptions), num: true },
  ], partitionRows, (p) => ({ "data-inbound-partition": p.site ? "site" : p.partition }),
  cannotRead("receiver_partitions", none("no inbound partition")));

  const nowMs = data.sampled_at_ms || Date.now();
  fillTable(document.getElementById("clients-table"), [
    { title: "client", value: (c) => c.client_id },
    { title: "durable", value: (c) => c.durable ? "yes" : "no" },
    { title: "connection", value: (c) => c.dropped ? "queue dropped at " + fmtClock(c.since_ms) + " (" + c.dropped + ")" :
        (c.connected ? "connected since " : "away since ") + fmtClock(c.since_ms) +
        (c.connected ? "" : " (" + fmtAge((nowMs - c.since_ms) / 1000) + ")"),
      cls: (c) => c.connected ? "state-running" : "state-stale" },
    { title: "primary", value: (c) => c.primary },
    { title: "queue size", value: (c) => fmtCount(c.queue_size), num: true },
    { title: "oldest message", value: (c) => fmtAge(c.oldest_age_s), num: true },
    { title: "redundancy", num: true,
      value: (c) => c.redundancy + (c.standbys < c.redundancy ? " (" + c.standbys + " standby)" : "") },
    { title: "received", value: (c) => fmtCount(c.received), num: true },
    { title: "repeats discarded", value: (c) => fmtCount(c.repeats), num: true },
    { title: "interest", value: (c) => c.interest, wrap: true },
  ], data.clients, (c) => ({ "data-client": c.client_id }), cannotRead("clients", none("no subscription client")));

  // Clean starts (start --clean-queues): who asked, when, and what each partition's primary dropped.
  const cleans = data.cleans || [];
  document.getElementById("cleans-section").hidden = cleans.length === 0 && !sectionErrors.cleans;
  const appliedBy = (c) => [...new Set(c.partitions.map((p) => p.applied_by).filter(Boolean))].join(", ") || "—";
  fillTable(document.getElementById("cleans-table"), [
    { title: "sender", value: (c) => c.queue_id },
    { title: "asked by", value: (c) => c.issued_by || "—", wrap: true },
    { title: "asked at", value: (c) => fmtDateTime(c.issued_at) },
    { title: "applied", value: (c) => c.applied + "/" + c.partitions.length, num: true,
      cls: (c) => c.applied < c.partitions.length ? "state-stale" : "" },
    { title: "events dropped", value: (c) => fmtCount(c.dropped), num: true },
    { title: "per partition (events dropped)", wrap: true,
      value: (c) => c.partitions.map((p) => p.partition + ": " + (p.dropped === null ? p.state : p.dropped)).join(", ") },
    { title: "applied by", value: appliedBy, wrap: true },
  ], cleans, (c) => ({ "data-clean": c.request_id, "data-queue": c.queue_id, "data-dropped": c.dropped }),
  cannotRead("cleans", none("no clean start")));

  renderCharts(data, ids);
}

function swatch(colour, text) {
  const span = document.createElement("span");
  const mark = document.createElement("span");
  mark.className = "swatch";
  mark.style.background = colour;
  span.append(mark, document.createTextNode(text));
  return span;
}

// --- actions: the same pause/resume/stop/start as `sluice admin` ----------------------------

function actionButtons(actions, queue) {
  const box = document.createElement("span");
  const states = new Set(queue.states);
  const already = { pause: "paused", resume: "running", start: "running", stop: "stopped" };
  for (const action of ["pause", "resume", "stop", "start"].filter((a) => actions.includes(a))) {
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = action;
    button.dataset.action = action;
    button.dataset.queue = queue.id;
    button.disabled = states.size === 1 && states.has(already[action]);
    button.addEventListener("click", () => act(queue.id, action));
    box.appendChild(button);
  }
  if (queue.kind === "gateway-sender") {
    // Geode's start gateway-sender --clean-queues: for a stopped sender only (the server checks too).
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = "start, clean queue";
    button.dataset.action = "clean-start";
    button.dataset.queue = queue.id;
    button.disabled = states.has("running") || states.has("paused");
    button.title = "drop every event queued now, then start (stop the sender first)";
    button.addEventListener("click", () => act(queue.id, "clean-start", queue.size));
    box.appendChild(button);
  }
  return box;
}

async function act(queueId, action, queued) {
  if (action === "stop" && !confirm("Stop " + queueId + "? Its dispatchers stop and close the listener " +
                                    "(nothing is dropped; start resumes).")) return;
  if (action === "clean-start" && !confirm("Drop every event queued in " + queueId + " (" + fmtCount(queued) +
                                           " at the last sample) and start it? The events are not sent, and " +
                                           "this cannot be undone; events written from now on are kept.")) return;
  const result = document.getElementById("action-result");
  result.textContent = action + " " + queueId + "…";
  try {
    // The server takes actions only as JSON from this page's own origin (a form on another site cannot
    // send application/json): the content type and the empty body {} are required.
    const response = await fetch("api/queues/" + encodeURIComponent(queueId) + "/" + action, {
      method: "POST", headers: { ...authHeaders(), "Content-Type": "application/json" }, body: "{}",
      credentials: "same-origin",
    });
    const body = await response.json().catch(() => ({}));
    if (response.status === 401) { askForToken("that token was refused"); return; }
    result.textContent = queueId + ": " +
      (response.ok ? body.message : action + " failed: " + (body.message || response.status));
    poll();
  } catch (err) {
    result.textContent = queueId + ": " + action + " failed: " + err.message;
  }
}

// --- charts: inline SVG, drawn here ----------------------------------------------------------

// The y axis: a round step (1, 2, 2.5 or 5 times a power of ten, at least minStep) and 2 to 4
// of them up to the top.
function yAxis(max, minStep) {
  if (!(max > 0)) return { step: minStep, top: 4 * minStep };
  const raw = max / 4;
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = Math.max(minStep, [1, 2, 2.5, 5, 10].map((m) => m * power).find((s) => s >= raw));
  return { step, top: Math.max(2, Math.ceil(max / step - 1e-9)) * step };
}

function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

// series: [{id, colour, cls, points: [[t_ms, value|null], ...]}]; a null value breaks the line.
function drawChart(svg, series, tEnd, windowS, format, minStep) {
  const box = svg.getBoundingClientRect();
  const W = Math.max(300, Math.round(box.width) || 600), H = Math.max(120, Math.round(box.height) || 190);
  svg.setAttribute("viewBox", "0 0 " + W + " " + H);
  while (svg.firstChild) svg.firstChild.remove();
  const left = 52, right = 10, top = 8, bottom = 20;
  const plotW = W - left - right, plotH = H - top - bottom;
  const tStart = tEnd - windowS * 1000;
  const values = series.flatMap((s) => s.points.map((p) => p[1])).filter((v) => v !== null);
  const { step: yStep, top: yMax } = yAxis(Math.max(0, ...values), minStep);
  const x = (t) => left + ((t - tStart) / (windowS * 1000)) * plotW;
  const y = (v) => top + plotH - (v / yMax) * plotH;

  for (let v = 0; v <= yMax + yStep / 2; v += yStep) {
    svg.appendChild(svgEl("line", { class: "grid", x1: left, x2: W - right, y1: y(v), y2: y(v) }));
    svg.appendChild(svgEl("text", { class: "axis", x: left - 5, y: y(v) + 3, "text-anchor": "end" }, format(v)));
  }
  const stepS = [10, 15, 30, 60, 120, 300, 600].find((step) => windowS / step <= 6) || 600;
  for (let ago = 0; ago <= windowS; ago += stepS) {
    const t = tEnd - ago * 1000;
    const label = ago === 0 ? "now" : ago % 60 === 0 ? "−" + ago / 60 + " min" : "−" + ago + " s";
    svg.appendChild(svgEl("line", { class: "grid", x1: x(t), x2: x(t), y1: top, y2: top + plotH }));
    svg.appendChild(svgEl("text", { class: "axis", x: x(t), y: H - 6,
                                    "text-anchor": ago === 0 ? "end" : ago === windowS ? "start" : "middle" }, label));
  }
  let drawn = 0;
  for (const s of series) {
    let run = [];
    const flush = () => {
      if (run.length >= 2) {
        svg.appendChild(svgEl("polyline", { class: "series " + s.cls, stroke: s.colour, "data-queue": s.id,
                                            points: run.join(" ") }));
        drawn++;
      } else if (run.length === 1) {
        const [cx, cy] = run[0].split(",");
        svg.appendChild(svgEl("circle", { class: "series " + s.cls, cx, cy, r: 2.5, fill: s.colour,
                                          "data-queue": s.id }));
      }
      run = [];
    };
    for (const [t, v] of s.points) {
      if (v === null || t < tStart) { flush(); continue; }
      run.push(x(t).toFixed(1) + "," + y(v).toFixed(1));
    }
    flush();
  }
  if (!drawn) {
    svg.appendChild(svgEl("text", { class: "note", x: left + plotW / 2, y: top + plotH / 2, "text-anchor": "middle" },
                          "collecting samples…"));
  }
}

function renderCharts(data, ids) {
  const points = data.history.points;
  const tEnd = points.length ? points[points.length - 1].t_ms : Date.now();
  // The x axis spans the history kept so far, in whole minutes, up to the server's window
  // (10 minutes by default): a page opened a minute ago shows that minute, not a sliver.
  const spanS = points.length ? (tEnd - points[0].t_ms) / 1000 : 0;
  const windowS = Math.min(data.history.window_s, Math.max(60, Math.ceil(spanS / 60) * 60));
  const minutes = Math.round(windowS / 60);
  document.getElementById("chart-window").textContent = minutes === 1 ? "minute" : minutes + " minutes";
  document.getElementById("chart-kept").textContent = fmtAge(data.history.window_s).replace(/ 0+s$/, "");
  const seriesOf = (index, cls) => ids.map((id) => ({
    id, cls, colour: queueColour(ids, id),
    points: points.map((p) => [p.t_ms, p.queues[id] ? p.queues[id][index] : null]),
  }));
  drawChart(document.getElementById("chart-size"), seriesOf(0, "size"), tEnd, windowS,
            (v) => fmtCount(Math.round(v)), 1);
  drawChart(document.getElementById("chart-rate"), [...seriesOf(1, "in"), ...seriesOf(2, "out")], tEnd, windowS,
            (v) => fmtRate(v), 0.1);
  const legend = document.getElementById("chart-legend");
  legend.replaceChildren(...ids.map((id) => {
    const span = document.createElement("span");
    span.style.setProperty("--swatch", queueColour(ids, id));
    span.textContent = id;
    return span;
  }));
}
