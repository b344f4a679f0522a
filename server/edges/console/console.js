// The MQKS console: polls the broker's JSON every 2 s and draws it. No framework, no network beyond this page.
// Every name (a queue's, an event's, a consumer's) is user input: it only ever goes in through text nodes,
// never through innerHTML, so `<script>` in a queue name shows as text.
"use strict";

const POLL_MS = 2000;
const HISTORY = 90; // samples kept for the chart: 3 minutes
const state = { session: null, samples: [], sort: { key: "queue", up: true }, filter: "", lastQueues: null, lastAction: "" };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function number(value) {
  return typeof value === "number" ? value.toLocaleString("en-US", { maximumFractionDigits: 1 }) : String(value ?? "-");
}

function bytes(value) {
  if (typeof value !== "number") return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit++; }
  return value.toFixed(unit ? 1 : 0) + " " + units[unit];
}

async function api(path, options) {
  const answer = await fetch(path, Object.assign({ credentials: "same-origin", cache: "no-store" }, options || {}));
  if (answer.status === 401) { location.href = "/login"; throw new Error("sign in first"); }
  const body = await answer.json();
  if (!answer.ok) throw new Error(body.error || answer.statusText);
  return body;
}

function route() {
  const hash = location.hash.replace(/^#\/?/, "");
  if (hash.startsWith("queue/")) return { view: "queue", name: decodeURIComponent(hash.slice(6)) };
  return { view: ["queues", "schedules"].includes(hash) ? hash : "overview" };
}

function tile(label, value, id) {
  return el("div", { class: "tile", id: id ? "tile-" + id : null },
    el("div", { class: "label" }, label), el("div", { class: "value" }, value));
}

function table(columns, rows, options) {
  const head = el("tr", {}, ...columns.map(([key, label, numeric]) => {
    const sorted = options && options.sort && options.sort.key === key;
    const cell = el("th", { class: (numeric ? "num " : "") + (sorted ? "sorted" + (options.sort.up ? " up" : "") : ""),
                            "data-key": key }, label);
    if (options && options.onsort) cell.addEventListener("click", () => options.onsort(key));
    return cell;
  }));
  const body = rows.length ? rows.map((row) => el("tr", { "data-name": row._name ?? "" },
    ...columns.map(([key, , numeric]) => {
      const value = row[key];
      return el("td", { class: numeric ? "num" : "" }, value instanceof Node ? value : numeric ? number(value) : value ?? "");
    })))
    : [el("tr", {}, el("td", { class: "empty", colspan: String(columns.length) }, "none"))];
  return el("table", { id: options && options.id ? options.id : null }, el("thead", {}, head), el("tbody", {}, ...body));
}

function rate(key) {
  const [a, b] = state.samples.slice(-2);
  if (!a || !b) return 0;
  const seconds = (b.at - a.at) / 1000;
  return seconds > 0 ? Math.max(0, (b.stats[key] - a.stats[key]) / seconds) : 0;
}

function drawChart(canvas) {
  const ratio = window.devicePixelRatio || 1;
  canvas.width = canvas.clientWidth * ratio;
  canvas.height = canvas.clientHeight * ratio;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  const width = canvas.clientWidth, height = canvas.clientHeight, pad = 24;
  const series = { published: "#2f6fde", consumed: "#1f9d63", acked: "#c27a1f" };
  const points = {};
  let top = 1;
  for (const key of Object.keys(series)) {
    points[key] = [];
    for (let i = 1; i < state.samples.length; i++) {
      const a = state.samples[i - 1], b = state.samples[i];
      const value = Math.max(0, (b.stats[key] - a.stats[key]) / ((b.at - a.at) / 1000));
      points[key].push(value);
      top = Math.max(top, value);
    }
  }
  ctx.strokeStyle = "#dde2ea";
  ctx.fillStyle = "#687385";
  ctx.font = "11px system-ui, sans-serif";
  ctx.beginPath(); ctx.moveTo(pad, height - pad); ctx.lineTo(width - 4, height - pad); ctx.stroke();
  ctx.fillText(number(Math.round(top)) + " /s", pad + 4, 12);
  for (const [key, color] of Object.entries(series)) {
    const values = points[key];
    ctx.strokeStyle = color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    values.forEach((value, i) => {
      const x = pad + (width - pad - 4) * (i + HISTORY - values.length) / (HISTORY - 1);
      const y = height - pad - (height - 2 * pad) * value / top;
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
  }
}

async function overview(view) {
  const [stats, topology] = await Promise.all([api("/api/stats"), api("/api/topology")]);
  state.samples.push({ at: Date.now(), stats });
  if (state.samples.length > HISTORY) state.samples.shift();
  const canvas = el("canvas", { id: "rates" });
  const workers = (topology.slot_map || []).map(([first, last, worker]) => ({ worker, slots: first + "–" + last,
    direct: ((topology.direct || []).find((d) => d.worker === worker) || {}).port ?? "" }));
  const log = stats.log || null;
  view.replaceChildren(
    el("div", { class: "tiles" },
      tile("connections", number(stats.connections), "connections"),
      tile("published /s", number(rate("published")), "published-rate"),
      tile("delivered /s", number(rate("consumed")), "consumed-rate"),
      tile("acked /s", number(rate("acked")), "acked-rate"),
      tile("published", number(stats.published), "published"),
      tile("waiting", number(stats.messages_waiting), "waiting"),
      tile("unacked", number(stats.messages_unacked), "unacked"),
      tile("queues", number(stats.queues), "queues"),
      tile("consumers", number(stats.consumers), "consumers"),
      tile("dead lettered", number(stats.dead_lettered), "dead-lettered"),
      tile("published to no queue", number(stats.unrouted), "unrouted"),
      tile("memory (this process)", bytes(topology.rss_bytes), "memory"),
      tile("memory full", stats.memory_full ? "yes: publishes refused" : "no", "memory-full"),
      tile("version", String(stats.version), "version"),
      tile("uptime", number(Math.round(stats.uptime_seconds)) + " s", "uptime")),
    el("h2", {}, "Rates"),
    el("div", { class: "legend" }, el("span", { class: "published" }, "— published"),
      el("span", { class: "consumed" }, "— delivered"), el("span", { class: "acked" }, "— acked")),
    canvas,
    el("h2", {}, "The log"),
    log ? table([["key", "figure"], ["value", "value"]],
                Object.entries(log).map(([key, value]) => ({ key, value: String(value) })), { id: "log" })
        : el("p", { class: "empty", id: "log" }, "in memory only: no --data-dir or --log"),
    el("h2", {}, topology.cluster ? "Node " + topology.node + " of cluster " + topology.cluster : "Workers"),
    workers.length ? table([["worker", "worker", true], ["slots", "slots"], ["direct", "direct port"]], workers,
                           { id: "workers" })
                   : el("p", { id: "workers" }, "one process: every slot (" + number(stats.workers || 1) + " worker)"));
  drawChart(canvas);
}

function queueLink(name) {
  return el("a", { href: "#/queue/" + encodeURIComponent(name), class: "name" }, name);
}

async function queues(view) {
  const rows = await api("/api/queues");
  const byName = new Map(rows.map((row) => [row.queue, row]));
  const previous = state.lastQueues;
  state.lastQueues = { at: Date.now(), depth: new Map(rows.map((row) => [row.queue, row.depth])) };
  const seconds = previous ? (state.lastQueues.at - previous.at) / 1000 : 0;
  const shown = rows.filter((row) => row.queue.includes(state.filter)).map((row) => {
    const flags = row.flags || [];
    const setting = (prefix) => (flags.find((flag) => flag.startsWith(prefix)) || "").slice(prefix.length) || "";
    const before = previous && previous.depth.get(row.queue);
    return Object.assign({}, row, {
      _name: row.queue,
      name: queueLink(row.queue),
      dead: (byName.get(row.queue + ".dead") || {}).depth ?? 0,
      trend: seconds > 0 && before !== undefined ? (row.depth - before) / seconds : 0,
      unused: flags.some((flag) => flag.startsWith("--delete-queue-when-unused")) ? "yes" : "",
      max_length: setting("--max-length="),
      max_retries: setting("--max-retries="),
    });
  });
  const { key, up } = state.sort;
  shown.sort((a, b) => {
    const x = key === "name" ? a.queue : a[key], y = key === "name" ? b.queue : b[key];
    return (x < y ? -1 : x > y ? 1 : 0) * (up ? 1 : -1);
  });
  const filter = el("input", { type: "search", id: "filter", placeholder: "filter by name", value: state.filter });
  filter.addEventListener("input", () => { state.filter = filter.value; refresh(); });
  view.replaceChildren(filter, table([
    ["name", "queue"], ["depth", "ready", true], ["unacked", "unacked", true], ["leased", "leased", true],
    ["consumers", "consumers", true], ["trend", "depth change /s", true], ["dead", "dead letters", true],
    ["bindings", "bindings", true], ["unused", "delete when unused"], ["max_length", "max length"],
    ["max_retries", "max retries"],
  ], shown, { id: "queues", sort: { key: key === "queue" ? "name" : key, up },
              onsort: (column) => { state.sort = { key: column, up: state.sort.key === column ? !state.sort.up : true };
                                    refresh(); } }));
  const focused = document.activeElement;
  if (!focused || focused === document.body) { filter.focus(); filter.setSelectionRange(filter.value.length, filter.value.length); }
}

async function queue(view, name) {
  const { queue: row, dead_letters: dead } = await api("/api/queue?name=" + encodeURIComponent(name));
  const actions = state.session && state.session.actions;
  if (!row) { view.replaceChildren(el("p", { class: "empty" }, "No queue ", el("span", { class: "name" }, name), " (now).")); return; }
  const children = [
    el("h2", {}, "Queue ", el("span", { class: "name", id: "queue-name" }, row.queue)),
    el("div", { class: "tiles" }, tile("ready", number(row.depth), "depth"), tile("unacked", number(row.unacked), "unacked"),
      tile("leased", number(row.leased), "leased"), tile("consumers", number(row.consumers), "consumers"),
      tile("dead letters", number(dead ? dead.depth : 0), "dead")),
    el("p", {}, "Settings: ", (row.flags || []).length ? el("code", {}, row.flags.join(" ")) : "none"),
    el("h2", {}, "Bindings (events and masks)"),
    table([["event", "event or mask"]], (row.events || []).map((event) => ({ event: el("span", { class: "name" }, event) })),
          { id: "bindings" }),
    el("h2", {}, "Consumers"),
    table([["consumer", "consumer"], ["manual_ack", "manual ack"], ["prefetch", "prefetch", true],
           ["unacked", "unacked", true], ["ack_timeout", "ack timeout (s)"]],
          (row.consumer_list || []).map((c) => Object.assign({}, c, { manual_ack: c.manual_ack ? "yes" : "no",
            prefetch: c.prefetch || "none", ack_timeout: c.ack_timeout ?? "" })), { id: "consumers" }),
    el("h2", {}, "Newest messages waiting"),
    table([["msg_id", "msg id"], ["event", "event"], ["retry", "retry", true], ["data", "data (its first 200 bytes)"]],
          row.newest || [], { id: "newest" }),
    el("h2", {}, "Newest dead letters (", el("span", { class: "name" }, row.queue + ".dead"), ")"),
    table([["msg_id", "msg id"], ["event", "event"], ["retry", "retry", true], ["data", "data (its first 200 bytes)"]]
            .concat(actions ? [["requeue", ""]] : []),
          (dead ? dead.newest || [] : []).map((letter) => Object.assign({}, letter, actions ? {
            requeue: el("button", { class: "requeue-one", onclick: () => act("requeue-dead", row.queue, [letter.msg_id]) },
                        "move back") } : {})), { id: "dead-letters" }),
  ];
  if (actions) {
    children.push(el("h2", {}, "Actions"), el("div", { class: "actions" },
      el("button", { id: "requeue-dead", disabled: dead && dead.depth ? null : "disabled",
                     onclick: () => act("requeue-dead", row.queue) }, "Move every dead letter back"),
      el("button", { class: "danger", id: "purge-queue", onclick: () => {
        if (confirm("Drop the " + number(row.depth) + " messages waiting in " + row.queue + "?")) act("purge", row.queue);
      } }, "Purge (drop what waits)"),
      el("button", { class: "danger", id: "delete-queue", onclick: async () => {
        if (!confirm("Delete the queue " + row.queue + " with its messages and bindings?")) return;
        if (await act("delete", row.queue)) location.hash = "#/queues";
      } }, "Delete this queue")),
      el("p", { id: "action-result", class: "note" }, state.lastAction || ""));
  }
  view.replaceChildren(...children);
}

// a POST of --console-actions; its outcome stays shown under the buttons until the next one
async function act(what, name, msgIds) {
  const query = "?name=" + encodeURIComponent(name) + (msgIds || []).map((id) => "&msg_id=" + encodeURIComponent(id)).join("");
  try {
    const done = await api("/api/queue/" + what + query, { method: "POST", headers: { "X-CSRF-Token": state.session.csrf } });
    state.lastAction = what === "delete" ? "deleted " + name : what === "purge" ? "purged " + number(done.purged) + " messages"
      : "moved " + number(done.requeued) + " dead letters back";
    return true;
  } catch (error) {
    state.lastAction = what + " failed: " + error.message;
    return false;
  } finally {
    refresh();
  }
}

async function schedules(view) {
  const rows = await api("/api/schedules");
  view.replaceChildren(table([["name", "schedule"], ["rule", "rule"], ["event", "event"], ["fired", "fired", true],
    ["count", "count"], ["next", "next due (UTC, as cron rules are)"]], rows.map((row) => Object.assign({}, row, {
      name: el("span", { class: "name" }, row.name), event: el("span", { class: "name" }, row.event),
      count: row.count ?? "no limit",
      next: row.next_due ? new Date(row.next_due * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC" : "" })),
    { id: "schedules" }));
}

let refreshing = null;
async function refresh() {
  if (refreshing) return refreshing;
  const where = route();
  for (const link of document.querySelectorAll("nav a")) {
    link.classList.toggle("active", link.id === "nav-" + (where.view === "queue" ? "queues" : where.view));
  }
  const view = document.getElementById("view");
  const status = document.getElementById("status");
  refreshing = (async () => {
    try {
      if (!state.session) {
        state.session = await api("/api/session");
        document.getElementById("logout").hidden = !state.session.auth;
      }
      if (where.view === "queues") await queues(view);
      else if (where.view === "queue") await queue(view, where.name);
      else if (where.view === "schedules") await schedules(view);
      else await overview(view);
      status.textContent = "updated " + new Date().toLocaleTimeString();
      status.className = "status";
    } catch (error) {
      status.textContent = "cannot read the broker: " + error.message;
      status.className = "status bad";
    } finally {
      refreshing = null;
    }
  })();
  return refreshing;
}

window.addEventListener("hashchange", () => { state.lastQueues = null; state.lastAction = ""; refresh(); });
window.addEventListener("DOMContentLoaded", () => { refresh(); setInterval(refresh, POLL_MS); });
