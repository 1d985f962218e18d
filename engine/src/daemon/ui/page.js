"use strict";
// crabd's page: the state (when the stream opens, and every 30 s), then
// each event as it happens, from the server-sent events of `live`.

const MAX_EVENTS = 200;
const ROWS = 12;
const sandboxes = new Map();
let host = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c);
  return node;
}

function ago(ms) {
  const s = Math.max(0, (Date.now() - ms) / 1000);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

function size(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = bytes, i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return `${v < 10 && i ? v.toFixed(1) : Math.round(v)} ${units[i]}`;
}

const ms = (v) => `${Math.round(v)} ms`;

// [mark class, mark text, description] of an event.
function describe(e) {
  switch (e.event) {
    case "turn":
      return e.error
        ? ["turn unknown", String(e.turn), `turn ${e.turn}: no version (${e.error})`]
        : [`turn ${e.class}`, String(e.turn), `turn ${e.turn}: ${e.class}, version ${e.version}`];
    case "checkpoint":
      return [`checkpoint ${e.class}`, "◆", `version ${e.version} (${e.class}${e.turn == null ? ", by hand" : `, turn ${e.turn}`}): ${size(e.bytes)}, frozen ${ms(e.frozen_ms)}, ${ms(e.total_ms)} in all`];
    case "hold":
      return ["hold", "▮", `turn ${e.turn}'s answer held ${ms(e.held_ms)}`];
    case "rollback":
      return ["rollback", "↶", `back to version ${e.version} in ${ms(e.total_ms)}${e.undo_ms == null ? "" : ` (undo ${ms(e.undo_ms)})`}${e.reason ? `: ${e.reason}` : ""}`];
    case "recovery":
      return ["recovery", "✚", `crashed (status ${e.exit_status}), version ${e.version} restored in ${ms(e.total_ms)}`];
    case "failed":
      return ["failed", "✖", `${e.what} failed: ${e.error}`];
    default:
      return ["", "?", e.event];
  }
}

function card(s) {
  const turns = s.events.filter((e) => e.event === "turn").length;
  const timeline = el("div", { class: "timeline" });
  for (const e of s.events) {
    const [cls, text, title] = describe(e);
    const attrs = { class: `mark ${cls}`, title, "data-event": e.event };
    if (e.turn != null) attrs["data-turn"] = String(e.turn);
    if (e.version != null) attrs["data-version"] = String(e.version);
    timeline.append(el("span", attrs, text));
  }
  if (!s.events.length) timeline.append(el("span", { class: "empty" }, "nothing yet"));
  const rows = s.events.slice(-ROWS).reverse().map((e) =>
    el("tr", { "data-event": e.event },
      el("td", { class: "when", title: new Date(e.at_unix_ms).toISOString() }, ago(e.at_unix_ms)),
      el("td", { class: "what" }, e.event),
      el("td", {}, describe(e)[2])));
  return el("section", { class: "sandbox", "data-sandbox": s.id },
    el("h2", {}, s.id, el("span", { class: s.running ? "state" : "state stopped" }, s.running ? "running" : "stopped")),
    el("p", { class: "meta" },
      `${s.namespace} · ${s.versions} versions${s.latest == null ? "" : `, newest ${s.latest}`} · ${turns} turns shown · ${s.recoveries} recoveries`),
    timeline,
    el("table", { class: "events" }, el("tbody", {}, ...rows)));
}

// The whole page: after the state is read.
function render() {
  dirty.clear();
  renderHost();
  const main = document.getElementById("sandboxes");
  const ids = [...sandboxes.keys()].sort();
  main.replaceChildren(...(ids.length ? ids.map((id) => card(sandboxes.get(id))) : [el("p", { class: "empty" }, "No sandboxes.")]));
}

function renderHost() {
  if (host) {
    const room = host.store_free_bytes == null ? "store room unknown" : `${size(host.store_free_bytes)} free in the store${host.store_min_free_bytes ? ` (floor ${size(host.store_min_free_bytes)})` : ""}`;
    document.getElementById("host").textContent =
      `queue ${host.queue_depth} · slots ${host.slots_in_use}/${host.slots} · ${room}`;
  }
}

// Sandboxes whose card an event changed, drawn again at the next frame:
// a burst of events redraws each card once, and the others not at all.
const dirty = new Set();

function touch(id) {
  if (!dirty.size) requestAnimationFrame(redraw);
  dirty.add(id);
}

function redraw() {
  for (const id of dirty) {
    const s = sandboxes.get(id);
    const old = [...document.querySelectorAll("section.sandbox")].find((n) => n.dataset.sandbox === id);
    if (!s || !old) return void render();
    old.replaceWith(card(s));
  }
  dirty.clear();
}

// Events that arrive while the state is read: applied on top of it.
let pending = null;
// A load asked for while one runs (events were missed): run again after.
let again = false;

async function load() {
  if (pending) {
    again = true;
    return;
  }
  pending = [];
  try {
    const r = await fetch("state", { cache: "no-store" });
    if (!r.ok) throw new Error(`state: ${r.status}`);
    const state = await r.json();
    host = state.host;
    sandboxes.clear();
    for (const s of state.sandboxes) sandboxes.set(s.id, s);
  } finally {
    const missed = pending;
    pending = null;
    for (const e of missed) apply(e);
    render();
    if (again) {
      again = false;
      load().catch(() => {});
    }
  }
}

function apply(e) {
  if (pending) return void pending.push(e);
  const s = sandboxes.get(e.sandbox);
  if (!s) return void load().catch(() => {});
  // An event the state already had (it was read after the event): only
  // events as new as the newest one shown can be.
  const line = JSON.stringify(e);
  const newest = s.events.length ? s.events[s.events.length - 1].at_unix_ms : -Infinity;
  if (e.at_unix_ms <= newest && s.events.some((x) => x.at_unix_ms === e.at_unix_ms && JSON.stringify(x) === line)) return;
  s.events.push(e);
  if (s.events.length > MAX_EVENTS) s.events.splice(0, s.events.length - MAX_EVENTS);
  if (e.event === "checkpoint") { s.versions += 1; s.latest = e.version; }
  if (e.event === "recovery") s.recoveries += 1;
  touch(e.sandbox);
}

function listen() {
  const link = document.getElementById("link");
  const live = new EventSource("live");
  // The state is read once the stream is open (at every reconnection):
  // nothing that happens after is missed.
  live.addEventListener("open", () => {
    link.textContent = "live";
    link.className = "link live";
    load().catch((e) => { document.getElementById("host").textContent = String(e); });
  });
  live.addEventListener("error", () => {
    link.className = "link down";
    // Closed for good: crabd stopped, or restarted with a new secret.
    link.textContent = live.readyState === EventSource.CLOSED
      ? "disconnected: crabd stopped or restarted (crabctl ui gives the new URL)"
      : "reconnecting…";
  });
  live.addEventListener("crab", (m) => apply(JSON.parse(m.data)));
  // Events were missed: start again from the state.
  live.addEventListener("lagged", () => load().catch(() => {}));
}

listen();
setInterval(() => load().catch(() => {}), 30000);
