// aenv dashboard: a page of plain JavaScript (no build step), served by a node or a gateway.
// Every value shown comes from the key-protected JSON API and enters the page as a DOM text node
// (textContent / createTextNode): nothing the API returns is ever parsed as HTML. The API key is
// entered once, kept in this tab's sessionStorage, and sent as the X-API-Key header only.

const KEY = "aenv-api-key";
const REFRESH_MS = 2000;
const WINDOW_S = 30; // rates and percentiles over the last 30 s of readings
const POINTS = 90; // points kept on a live chart
const OPS = ["create", "pause", "resume", "fork", "snapshot", "kill"];
// How commands run in sandboxes ended (aenv_commands_total), with their column titles
const OUTCOMES = [["ok", "Exit 0"], ["nonzero", "Exit ≠ 0"], ["timeout", "Timeout"], ["error", "Error"], ["detached", "Detached"]];
const COLORS = ["#2f6fdf", "#1f9d55", "#c98a00", "#8e44ad", "#16a2b8", "#d64545", "#6a7383"];

class NeedKey extends Error {}

let timer = null;
let charts = [];
let generation = 0; // a view's refreshes stop once another view is shown
const readings = []; // {t, stats}: the cluster's counters as last read, oldest first
const series = { t: [], rates: {}, p50: [], p90: [], p99: [] };

// -- helpers ----------------------------------------------------------------------------------
function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") el.className = value;
    else if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else el.setAttribute(name, String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

function key() {
  return sessionStorage.getItem(KEY) || "";
}

async function api(path) {
  const response = await fetch(path, {
    headers: { "X-API-Key": key(), Accept: "application/json" },
    credentials: "omit",
    cache: "no-store",
  });
  if (response.status === 401) throw new NeedKey();
  if (!response.ok) {
    let message = response.statusText;
    try {
      message = (await response.json()).message || message;
    } catch (_) { /* not JSON */ }
    throw new Error(`${response.status}: ${message}`);
  }
  return { body: await response.json(), headers: response.headers };
}

function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function ago(value) {
  const at = typeof value === "number" ? value * 1000 : Date.parse(value);
  if (!at) return "—";
  const s = Math.max(0, Math.round((Date.now() - at) / 1000));
  if (s < 90) return `${s}s ago`;
  if (s < 5400) return `${Math.round(s / 60)}m ago`;
  if (s < 129600) return `${Math.round(s / 3600)}h ago`;
  return `${Math.round(s / 86400)}d ago`;
}

function badge(text) {
  return h("span", { class: `badge ${String(text).replace(/[^a-z]/g, "")}` }, text);
}

function bar(used, total) {
  const fraction = total > 0 ? Math.min(1, used / total) : 0;
  const fill = h("span");
  fill.style.width = `${(fraction * 100).toFixed(1)}%`;
  return h("div", { class: fraction > 0.85 ? "bar high" : "bar", title: `${(fraction * 100).toFixed(0)}%` }, fill);
}

function table(columns, rows, rowAttrs = () => ({})) {
  return h(
    "table",
    {},
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", { class: c.num ? "num" : null }, c.title)))),
    h(
      "tbody",
      {},
      rows.length
        ? rows.map((row) => h("tr", rowAttrs(row), columns.map((c) => h("td", { class: c.num ? "num" : null }, c.cell(row)))))
        : h("tr", {}, h("td", { colspan: columns.length, class: "muted" }, "none")),
    ),
  );
}

function setStatus(text, bad = false) {
  const el = document.getElementById("status");
  el.textContent = text;
  el.className = bad ? "status error" : "status";
}

function chart(canvas, type, datasets, options = {}) {
  const c = new window.Chart(canvas, {
    type,
    data: { labels: [], datasets },
    options: {
      animation: false,
      responsive: true,
      maintainAspectRatio: false,
      interaction: { mode: "index", intersect: false },
      plugins: { legend: { position: "bottom", labels: { boxWidth: 12 } } },
      ...options,
    },
  });
  charts.push(c);
  return c;
}

// -- stats: rates and percentiles from two readings of cumulative counters --------------------
function opTotal(stats, op) {
  const outcomes = stats.operations[op] || {};
  return Object.values(outcomes).reduce((a, b) => a + b, 0);
}

function quantile(q, buckets) {
  // buckets: [[le, cumulative count]] sorted, the last "+Inf" (as Prometheus' histogram_quantile)
  if (!buckets.length) return null;
  const total = buckets[buckets.length - 1][1];
  if (total <= 0) return null;
  const rank = q * total;
  let prevBound = 0;
  let prevCount = 0;
  for (const [le, count] of buckets) {
    const bound = Number(le);
    if (count >= rank) {
      if (!Number.isFinite(bound)) return prevBound;
      return prevBound + ((bound - prevBound) * (rank - prevCount)) / Math.max(count - prevCount, 1e-9);
    }
    prevBound = bound;
    prevCount = count;
  }
  return prevBound;
}

function bucketDelta(now, then) {
  const before = new Map(then ? then.buckets : []);
  return now.buckets.map(([le, count]) => [le, count - (before.get(le) || 0)]);
}

function record(stats) {
  const t = Date.now() / 1000;
  readings.push({ t, stats });
  while (readings.length > 1 && t - readings[0].t > WINDOW_S) readings.shift();
  const first = readings[0];
  const span = t - first.t;
  series.t.push(new Date(t * 1000).toLocaleTimeString());
  for (const op of OPS) {
    const rate = span > 0 ? (opTotal(stats, op) - opTotal(first.stats, op)) / span : 0;
    (series.rates[op] = series.rates[op] || []).push(Math.max(0, rate));
  }
  const op = document.getElementById("latency-op")?.value || "create";
  const hist = stats.latency[op];
  const delta = hist ? bucketDelta(hist, first.stats.latency[op]) : [];
  for (const [q, name] of [[0.5, "p50"], [0.9, "p90"], [0.99, "p99"]]) series[name].push(quantile(q, delta));
  for (const list of [series.t, series.p50, series.p90, series.p99, ...Object.values(series.rates)]) {
    while (list.length > POINTS) list.shift();
  }
}

function commandsTable(stats) {
  // Totals by outcome since start; the rate and start latency (request to running in the sandbox)
  // over the window of readings, as the operations' charts.
  const first = readings[0];
  const span = first ? readings[readings.length - 1].t - first.t : 0;
  const total = (s) => Object.values(s.commands || {}).reduce((a, b) => a + b, 0);
  const delta = first ? bucketDelta(stats.commandStart || { buckets: [] }, first.stats.commandStart) : [];
  const fixed = (v, digits) => (v === null || v === undefined ? "—" : v.toFixed(digits));
  const row = { rate: span > 0 ? fixed(Math.max(0, (total(stats) - total(first.stats)) / span), 2) : "—" };
  for (const [outcome] of OUTCOMES) row[outcome] = (stats.commands || {})[outcome] || 0;
  for (const [q, name] of [[0.5, "p50"], [0.9, "p90"], [0.99, "p99"]]) row[name] = fixed(quantile(q, delta), 3);
  return table(
    [
      { title: `Per second (last ${WINDOW_S}s)`, num: true, cell: (r) => r.rate },
      ...OUTCOMES.map(([outcome, title]) => ({ title, num: true, cell: (r) => r[outcome] })),
      ...["p50", "p90", "p99"].map((name) => ({ title: `Start ${name} (s)`, num: true, cell: (r) => r[name] })),
    ],
    [row],
  );
}

// -- views --------------------------------------------------------------------------------------
function loginView(main, message) {
  const input = h("input", { type: "password", name: "key", autocomplete: "current-password", placeholder: "API key", required: true });
  const form = h(
    "form",
    {
      onsubmit: (event) => {
        event.preventDefault();
        sessionStorage.setItem(KEY, input.value);
        show();
      },
    },
    h("label", { for: "key" }, "The node's or gateway's API key (AENV_API_KEY)"),
    input,
    h("button", { class: "primary", type: "submit" }, "Open the dashboard"),
  );
  input.id = "key";
  main.replaceChildren(
    h(
      "div",
      { class: "panel login" },
      h("h1", {}, "aenv dashboard"),
      message ? h("p", { class: "error" }, message) : null,
      h("p", { class: "muted" }, "The key stays in this browser tab (sessionStorage) and goes to the API as a header only."),
      form,
    ),
  );
  input.focus();
}

function nodeRows(nodes) {
  return table(
    [
      { title: "Node", cell: (n) => h("span", { class: "mono" }, n.nodeID) },
      { title: "State", cell: (n) => badge(n.status) },
      { title: "Running", num: true, cell: (n) => n.running },
      { title: "Paused", num: true, cell: (n) => n.paused },
      { title: "Busy", num: true, cell: (n) => n.starting },
      { title: "Capacity", cell: (n) => [`${n.running + n.starting} / ${n.maxSandboxes}`, bar(n.running + n.starting, n.maxSandboxes)] },
      { title: "Load (1m)", num: true, cell: (n) => `${n.load1} / ${n.cpuCount} cores` },
      { title: "Layer cache", cell: (n) => n.cacheBudgetBytes ? [`${bytes(n.cacheBytes)} of ${bytes(n.cacheBudgetBytes)}`, bar(n.cacheBytes, n.cacheBudgetBytes)] : "—" },
      { title: "Uncommitted", num: true, cell: (n) => n.repoPending ?? "—" },
      { title: "Version", cell: (n) => n.version },
    ],
    nodes,
    (n) => ({ "data-node-id": n.nodeID }),
  );
}

function overviewView(main) {
  const cards = h("div", { class: "cards" });
  const nodes = h("div");
  const opSelect = h("select", { id: "latency-op" }, OPS.map((op) => h("option", { value: op }, op)));
  const rateCanvas = h("canvas", { id: "chart-rates" });
  const latencyCanvas = h("canvas", { id: "chart-latency" });
  const failureCanvas = h("canvas", { id: "chart-failures" });
  const commands = h("div", { id: "commands" });
  main.replaceChildren(
    h("h1", {}, "Overview"),
    cards,
    h("h2", {}, "Nodes"),
    nodes,
    h("h2", {}, "Live"),
    h(
      "div",
      { class: "charts" },
      h("div", { class: "panel" }, h("strong", {}, `Operations per second (last ${WINDOW_S}s)`), h("div", { class: "chart-box" }, rateCanvas)),
      h("div", { class: "panel" }, h("strong", {}, "Latency (s) of "), opSelect, h("div", { class: "chart-box" }, latencyCanvas)),
      h("div", { class: "panel" }, h("strong", {}, "Failures by reason (since start)"), h("div", { class: "chart-box" }, failureCanvas)),
    ),
    h("h2", {}, "Commands in sandboxes"),
    commands,
  );
  opSelect.addEventListener("change", () => {
    for (const name of ["p50", "p90", "p99"]) series[name].length = 0;
    series.t.length = 0;
    for (const list of Object.values(series.rates)) list.length = 0;
  });
  const rates = chart(rateCanvas, "line", OPS.map((op, i) => ({ label: op, data: [], borderColor: COLORS[i], pointRadius: 0, tension: 0.2 })), {
    scales: { y: { beginAtZero: true } },
  });
  const latency = chart(latencyCanvas, "line", ["p50", "p90", "p99"].map((name, i) => ({ label: name, data: [], borderColor: COLORS[i], pointRadius: 0, spanGaps: true })), {
    scales: { y: { beginAtZero: true } },
  });
  const failures = chart(failureCanvas, "bar", [{ label: "failures", data: [], backgroundColor: "#d64545" }], {
    plugins: { legend: { display: false } },
    scales: { y: { beginAtZero: true, ticks: { precision: 0 } } },
  });
  return async () => {
    const [{ body: nodeList }, { body: stats }] = await Promise.all([api("/dashboard/api/nodes"), api("/dashboard/api/stats")]);
    const sum = (f) => nodeList.reduce((a, n) => a + (Number(f(n)) || 0), 0);
    cards.replaceChildren(
      ...[
        ["Nodes", `${nodeList.filter((n) => n.status === "ready").length} / ${nodeList.length} ready`],
        ["Running", sum((n) => n.running)],
        ["Paused", sum((n) => n.paused)],
        ["Capacity left", sum((n) => n.maxSandboxes - n.running - n.starting)],
        ["Layer cache", bytes(sum((n) => n.cacheBytes))],
        ["Uncommitted", sum((n) => n.repoPending)],
      ].map(([label, value]) => h("div", { class: "panel card" }, h("div", { class: "label" }, label), h("div", { class: "value" }, value))),
    );
    nodes.replaceChildren(nodeRows(nodeList));
    record(stats);
    rates.data.labels = series.t;
    OPS.forEach((op, i) => { rates.data.datasets[i].data = series.rates[op]; });
    rates.update();
    latency.data.labels = series.t;
    ["p50", "p90", "p99"].forEach((name, i) => { latency.data.datasets[i].data = series[name]; });
    latency.update();
    const reasons = [];
    for (const [op, byReason] of Object.entries(stats.failures)) {
      for (const [reason, count] of Object.entries(byReason)) reasons.push([`${op}: ${reason}`, count]);
    }
    reasons.sort((a, b) => b[1] - a[1]);
    failures.data.labels = reasons.map((r) => r[0]);
    failures.data.datasets[0].data = reasons.map((r) => r[1]);
    failures.update();
    commands.replaceChildren(commandsTable(stats));
  };
}

function sandboxesView(main, params) {
  const state = h("select", { name: "state" }, ["running,paused", "running", "paused"].map((s) => h("option", { value: s, selected: params.get("state") === s }, s.replace(",", " + "))));
  const template = h("input", { name: "template", placeholder: "any", value: params.get("template") || "" });
  const metadata = h("input", { name: "metadata", placeholder: "key=value&key2=value2", value: params.get("metadata") || "" });
  const list = h("div");
  const count = h("p", { class: "muted" });
  const form = h(
    "form",
    {
      class: "filters",
      onsubmit: (event) => {
        event.preventDefault();
        const query = new URLSearchParams();
        if (state.value !== "running,paused") query.set("state", state.value);
        if (template.value) query.set("template", template.value);
        if (metadata.value) query.set("metadata", metadata.value);
        location.hash = `#/sandboxes?${query}`;
      },
    },
    h("label", {}, "State", state),
    h("label", {}, "Template", template),
    h("label", {}, "Metadata", metadata),
    h("button", { class: "primary", type: "submit" }, "Filter"),
  );
  main.replaceChildren(h("h1", {}, "Sandboxes"), form, count, list);
  return async () => {
    const query = new URLSearchParams({ limit: "100" });
    for (const s of (params.get("state") || "running,paused").split(",")) query.append("state", s);
    if (params.get("template")) query.set("template", params.get("template"));
    if (params.get("metadata")) query.set("metadata", params.get("metadata"));
    const { body, headers } = await api(`/v2/sandboxes?${query}`);
    count.textContent = `${body.length} sandbox${body.length === 1 ? "" : "es"}${headers.get("x-next-token") ? " (the newest 100)" : ""}`;
    list.replaceChildren(
      table(
        [
          { title: "Sandbox", cell: (s) => h("a", { class: "mono", href: `#/sandbox/${encodeURIComponent(s.sandboxID)}` }, s.sandboxID) },
          { title: "Template", cell: (s) => s.alias || s.templateID },
          { title: "State", cell: (s) => badge(s.state) },
          { title: "Node", cell: (s) => s.nodeID || "—" },
          { title: "Started", cell: (s) => ago(s.startedAt) },
          { title: "Ends", cell: (s) => new Date(s.endAt).toLocaleString() },
          { title: "CPU / memory", cell: (s) => `${s.cpuCount} / ${s.memoryMB} MiB` },
          { title: "Metadata", cell: (s) => Object.entries(s.metadata || {}).map(([k, v]) => h("div", { class: "mono" }, `${k}=${v}`)) },
        ],
        body,
        (s) => ({ "data-sandbox-id": s.sandboxID }),
      ),
    );
  };
}

function familyTree(family) {
  const byParent = new Map();
  for (const m of family.members) {
    const parent = m.parentID || "";
    if (!byParent.has(parent)) byParent.set(parent, []);
    byParent.get(parent).push(m);
  }
  const ids = new Set(family.members.map((m) => m.sandboxID));
  const item = (m) =>
    h(
      "li",
      {},
      h("a", { class: m.sandboxID === family.sandboxID ? "mono current" : "mono", href: `#/sandbox/${encodeURIComponent(m.sandboxID)}` }, m.sandboxID),
      " ",
      badge(m.state),
      byParent.has(m.sandboxID) ? h("ul", {}, byParent.get(m.sandboxID).map(item)) : null,
    );
  const roots = family.members.filter((m) => !m.parentID || !ids.has(m.parentID));
  return h(
    "div",
    {},
    family.ancestors.length ? h("p", { class: "muted" }, `forked from ${family.ancestors.join(" ← ")}`) : null,
    h("ul", { class: "family" }, roots.map(item)),
    family.truncated ? h("p", { class: "muted" }, "(more not shown)") : null,
  );
}

function sandboxView(main, sandboxId) {
  const info = h("dl", { class: "detail" });
  const commands = h("div");
  const family = h("div");
  const log = h("pre", { class: "log" });
  const canvas = h("canvas", { id: "chart-sandbox" });
  main.replaceChildren(
    h("h1", {}, "Sandbox ", h("span", { class: "mono" }, sandboxId)),
    h("div", { class: "panel" }, info),
    h("h2", {}, "Resource use"),
    h("div", { class: "panel" }, h("div", { class: "chart-box" }, canvas)),
    h("h2", {}, "Recent commands"),
    commands,
    h("h2", {}, "Fork family"),
    h("div", { class: "panel" }, family),
    h("h2", {}, "Agent log"),
    log,
  );
  const usage = chart(
    canvas,
    "line",
    [
      { label: "CPU %", data: [], borderColor: COLORS[0], pointRadius: 0, yAxisID: "cpu" },
      { label: "memory MiB", data: [], borderColor: COLORS[1], pointRadius: 0, yAxisID: "mem" },
    ],
    { scales: { cpu: { position: "left", beginAtZero: true }, mem: { position: "right", beginAtZero: true, grid: { drawOnChartArea: false } } } },
  );
  const path = `/sandboxes/${encodeURIComponent(sandboxId)}`;
  return async () => {
    const [{ body: sb }, { body: metrics }, { body: logs }, { body: fam }] = await Promise.all([
      api(path),
      api(`${path}/metrics`),
      api(`${path}/logs?limit=200`),
      api(`${path}/family`),
    ]);
    const rows = [
      ["State", badge(sb.state)],
      ["Template", sb.alias || sb.templateID],
      ["Node", sb.nodeID || "—"],
      ["Started", `${new Date(sb.startedAt).toLocaleString()} (${ago(sb.startedAt)})`],
      ["Ends", new Date(sb.endAt).toLocaleString()],
      ["CPU / memory / disk", `${sb.cpuCount} cores / ${sb.memoryMB} MiB / ${sb.diskSizeMB} MiB`],
      ["Metadata", Object.entries(sb.metadata || {}).map(([k, v]) => h("div", { class: "mono" }, `${k}=${v}`))],
    ];
    const view = desktopView(sb);
    if (view) rows.push(["Live desktop", view]);
    info.replaceChildren(...rows.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
    usage.data.labels = metrics.map((m) => new Date(m.timestampUnix * 1000).toLocaleTimeString());
    usage.data.datasets[0].data = metrics.map((m) => m.cpuUsedPct);
    usage.data.datasets[1].data = metrics.map((m) => Math.round(m.memUsed / 1048576));
    usage.update();
    commands.replaceChildren(
      table(
        [
          { title: "Command", cell: (c) => h("code", {}, c.cmd) },
          { title: "User", cell: (c) => c.user || "—" },
          { title: "Started", cell: (c) => ago(c.startedAt) },
          { title: "Exit", num: true, cell: (c) => (c.exitCode === null ? (c.error ? badge("failed") : c.endedAt ? "?" : "running") : c.exitCode) },
          { title: "How it ended", cell: (c) => c.error || c.status || "" },
        ],
        logs.commands,
        (c) => ({ "data-exit-code": c.exitCode }),
      ),
    );
    family.replaceChildren(familyTree(fam));
    log.textContent = logs.logs.map((l) => l.line).join("\n") || "(nothing logged for this sandbox)";
  };
}

// A desktop sandbox's live view (noVNC on its port 6080, through the node's port proxy, which routes
// a host named 6080-<id>.<anything>): once its stream runs (`aenv desktop <id>`, or the SDK's
// stream.start()).
function desktopView(sb) {
  const template = sb.alias || sb.templateID || "";
  if (template.split(":")[0] !== "desktop") return null;
  const query = "vnc.html?autoconnect=true&resize=scale";
  const local = ["localhost", "127.0.0.1", "[::1]"].includes(location.hostname);
  const host = sb.domain ? `https://6080-${sb.sandboxID}.${sb.domain}` : local ? `${location.protocol}//6080-${sb.sandboxID}.localhost:${location.port}` : null;
  const hint = h("div", { class: "muted" }, "start its stream first: ", h("code", {}, `aenv desktop ${sb.sandboxID}`));
  if (!host) return hint;
  return h("div", {}, h("a", { href: `${host}/${query}`, target: "_blank", rel: "noopener", "data-live-desktop": "1" }, "open the live view"), hint);
}

function templatesView(main) {
  const list = h("div");
  main.replaceChildren(h("h1", {}, "Templates and snapshots"), list);
  return async () => {
    const { body } = await api("/dashboard/api/artifacts");
    list.replaceChildren(
      table(
        [
          { title: "Kind", cell: (a) => a.kind },
          { title: "Name", cell: (a) => h("span", { class: "mono" }, a.name || a.id) },
          { title: "Id", cell: (a) => h("span", { class: "mono muted" }, a.id) },
          { title: "From sandbox", cell: (a) => a.source || "" },
          { title: "Created", cell: (a) => ago(a.createdAt) },
          { title: "Size", num: true, cell: (a) => bytes(a.sizeBytes) },
          { title: "Repository", cell: (a) => badge(a.committed ? "committed" : "pending") },
          { title: "Cached on", cell: (a) => (a.cachedOn.length ? a.cachedOn.join(", ") : "repository only") },
        ],
        body,
        (a) => ({ "data-artifact-id": a.id }),
      ),
    );
  };
}

function teamsView(main) {
  // The teams this key sees (its own; every team for the admin key) with what each used so far.
  const list = h("div");
  main.replaceChildren(h("h1", {}, "Teams and usage"), list);
  const fixed = (n, digits = 1) => (Number(n) || 0).toFixed(digits);
  return async () => {
    const { body: teams } = await api("/teams");
    const usage = await Promise.all(teams.map((t) => api(`/teams/${encodeURIComponent(t.teamID)}/usage`).then((r) => r.body)));
    const rows = teams.map((t, i) => ({ ...t, usage: usage[i] }));
    const quota = (q) => Object.entries(q || {}).filter(([, v]) => v).map(([k, v]) => `${k} ${v}`).join(", ") || "none";
    list.replaceChildren(
      table(
        [
          { title: "Team", cell: (t) => h("span", {}, t.name, " ", h("span", { class: "mono muted" }, t.teamID)) },
          { title: "Running", num: true, cell: (t) => t.usage.runningSandboxes },
          { title: "Paused", num: true, cell: (t) => t.usage.pausedSandboxes },
          { title: "Sandbox-hours", num: true, cell: (t) => fixed(t.usage.sandboxSeconds / 3600, 2) },
          { title: "CPU-seconds", num: true, cell: (t) => fixed(t.usage.cpuSeconds) },
          { title: "Memory GiB-hours", num: true, cell: (t) => fixed(t.usage.memoryGiBSeconds / 3600, 2) },
          { title: "Storage GiB-hours", num: true, cell: (t) => fixed(t.usage.storageGiBSeconds / 3600, 2) },
          { title: "Quotas", cell: (t) => quota(t.quotas) },
        ],
        rows,
        (t) => ({ "data-team-id": t.teamID }),
      ),
    );
  };
}

// -- routing --------------------------------------------------------------------------------------
function route() {
  const [path, query] = (location.hash.slice(1) || "/").split("?");
  const params = new URLSearchParams(query || "");
  if (path.startsWith("/sandbox/")) return ["sandboxes", (main) => sandboxView(main, decodeURIComponent(path.slice(9)))];
  if (path === "/sandboxes") return ["sandboxes", (main) => sandboxesView(main, params)];
  if (path === "/templates") return ["templates", templatesView];
  if (path === "/teams") return ["teams", teamsView];
  return ["overview", overviewView];
}

function show() {
  generation += 1;
  const mine = generation;
  clearTimeout(timer);
  for (const c of charts) c.destroy();
  charts = [];
  readings.length = 0;
  for (const list of [series.t, series.p50, series.p90, series.p99, ...Object.values(series.rates)]) list.length = 0;
  const main = document.getElementById("main");
  const [name, view] = route();
  for (const a of document.querySelectorAll("header nav a")) a.classList.toggle("active", a.dataset.view === name);
  const refresh = view(main);
  const tick = async () => {
    if (mine !== generation) return;
    try {
      await refresh();
      setStatus(`updated ${new Date().toLocaleTimeString()}`);
      document.body.dataset.loaded = name;
    } catch (error) {
      if (mine !== generation) return;
      if (error instanceof NeedKey) {
        loginView(main, key() ? "That key was refused." : "");
        setStatus("");
        return;
      }
      setStatus(String(error.message || error), true);
    }
    if (mine === generation) timer = setTimeout(tick, REFRESH_MS);
  };
  tick();
}

document.getElementById("forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  show();
});
window.addEventListener("hashchange", show);
window.addEventListener("load", show);
