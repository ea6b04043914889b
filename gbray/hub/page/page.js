// The hub's status page. Every string a device sent is shown as text: the DOM is built with
// createElement and textContent, never from markup; the hub's Content-Security-Policy forbids
// inline script, so a missed case is blocked rather than run.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const params = new URLSearchParams(location.search);
let token = params.get("token") || localStorage.getItem("gbray-token") || "";
let owner = false;
let selected = params.get("round");
if (params.has("token")) {
  // Keep the token out of the address bar, the history and any log that sees the URL.
  localStorage.setItem("gbray-token", token);
  params.delete("token");
  history.replaceState(null, "", location.pathname + (params.toString() ? "?" + params : ""));
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else node.setAttribute(k, String(v));
  }
  for (const child of children) node.append(child instanceof Node ? child : text(child));
  return node;
}
function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}
const text = (v) => document.createTextNode(v === null || v === undefined ? "–" : String(v));
const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);
const fmt = (v, d = 1) => (num(v) === null ? "–" : num(v).toFixed(d));

async function api(path, opts = {}) {
  const r = await fetch(path, { ...opts, headers: { Authorization: "Bearer " + token } });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(r.status + " " + (typeof body.detail === "string" ? body.detail : r.statusText));
  return body;
}
function say(message) { $("msg").textContent = message; }

$("token").value = token;
$("save").addEventListener("click", () => {
  token = $("token").value.trim();
  localStorage.setItem("gbray-token", token);
  refresh();
});

async function refresh() {
  try {
    const me = await api("/v1/whoami");
    owner = me.owner === true;
    $("who").textContent = "as " + me.name + (owner ? " (owner)" : "");
    const s = await api("/v1/training/state");
    say("");
    const c = s.coverage, sv = s.serving;
    $("summary").textContent =
      `corpus ${c.corpus} turns · trained ${c.trained} (${fmt(100 * c.share)}%) · handed out ${c.handed_out}` +
      (sv ? ` · serving ${sv.round} since ${new Date(sv.since * 1000).toLocaleString()}` : " · nothing serves yet");
    const body = $("rounds").tBodies[0];
    body.replaceChildren(...s.rounds.map((r) => roundRow(r, sv)));
    served(Array.isArray(s.decisions) ? s.decisions : []);
    servedTools(s.tools_served && typeof s.tools_served.tools === "object" ? s.tools_served.tools : {});
    if (selected) await detail(selected);
  } catch (e) { say(e.message); }
}

function roundRow(r, sv) {
  const baseline = num(r.baseline), result = num(r.result);
  const cls = baseline === null || result === null ? "" : (result > baseline ? "beat" : "lost");
  const tr = el("tr", { class: "round" + (r.id === selected ? " sel" : "") },
    el("td", {}, r.id),
    el("td", {}, r.device),
    el("td", {}, r.student ?? r.base),
    el("td", {}, (r.start ?? "–") + (r.trial ? " (trial)" : "")),
    el("td", {}, part(r)),
    el("td", {}, r.status + (r.stop ? " (stop asked)" : "")),
    el("td", {}, num(r.trained) ?? "–"),
    el("td", {}, fmt(baseline)),
    el("td", { class: cls }, fmt(result)),
    el("td", {}, num(r.p_value) === null ? "–" : num(r.p_value).toPrecision(2)),
    el("td", {}, sv && sv.round === r.id ? "serving" : ""));
  tr.addEventListener("click", () => { selected = r.id; refresh(); });
  return tr;
}

// A share names the merge round it is part of; a merge, how many shares it joins.
function part(r) {
  if (num(r.share) !== null && typeof r.share_of === "string") return `share ${r.share} of ${r.share_of}`;
  if (num(r.merge_of) !== null) return `merge of ${r.merge_of} shares`;
  return "";
}

function curve(points) {
  const box = $("curve"), W = 640, H = 220, P = 34;
  const val = points.filter((p) => num(p.valLoss) !== null && num(p.step) !== null);
  const tr = points.filter((p) => num(p.trainLoss) !== null && num(p.step) !== null);
  const agr = points.filter((p) => num(p.valAgreement) !== null && num(p.step) !== null);
  if (!val.length) {
    const t = svg("text", { x: 10, y: 20, fill: "#777" });
    t.textContent = "no validation yet";
    box.replaceChildren(t);
    return;
  }
  const all = val.map((p) => p.valLoss).concat(tr.map((p) => p.trainLoss));
  const xs = val.concat(tr).map((p) => p.step), x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  const y0 = Math.min(...all), y1 = Math.max(...all, y0 + 1e-6);
  const X = (s) => P + (W - 2 * P) * (s - x0) / (x1 - x0), Y = (v) => H - P - (H - 2 * P) * (v - y0) / (y1 - y0);
  const A = (v) => H - P - (H - 2 * P) * v / 100;  // agreement, 0-100 %, on the right axis
  const parts = [];
  // The cool-down, shaded from its first check to the last.
  const cooling = points.filter((p) => p.phase === "cool-down" && num(p.step) !== null);
  if (cooling.length) {
    const c0 = X(Math.min(...cooling.map((p) => p.step))), c1 = X(Math.max(...cooling.map((p) => p.step)));
    parts.push(svg("rect", { x: c0, y: P, width: Math.max(2, c1 - c0), height: H - 2 * P, fill: "#fdf1dc" }));
  }
  parts.push(svg("line", { x1: P, y1: H - P, x2: W - P, y2: H - P, stroke: "#999" }),
    svg("line", { x1: P, y1: P, x2: P, y2: H - P, stroke: "#999" }));
  const label = (x, y, s, color = "#222") => {
    const t = svg("text", { x, y, "font-size": 11, fill: color }); t.textContent = s; return t;
  };
  parts.push(label(P, H - 8, "step " + x0), label(W - P - 60, H - 8, "step " + x1),
    label(2, P - 8, y1.toFixed(3)), label(2, H - P + 12, y0.toFixed(3)));
  if (agr.length) {
    parts.push(svg("line", { x1: W - P, y1: P, x2: W - P, y2: H - P, stroke: "#999" }),
      label(W - P - 8, P - 8, "100%", "#0a7a2f"), label(W - P + 2, H - P + 12, "0%", "#0a7a2f"));
  }
  for (const [ps, at, color] of [[tr, (p) => Y(p.trainLoss), "#aaa"], [val, (p) => Y(p.valLoss), "#1f5fd1"],
    [agr, (p) => A(p.valAgreement), "#0a7a2f"]]) {
    parts.push(svg("polyline", { fill: "none", stroke: color, "stroke-width": 2,
      points: ps.map((p) => X(p.step) + "," + at(p)).join(" ") }));
    for (const p of ps) parts.push(svg("circle", { cx: X(p.step), cy: at(p), r: p.best === true ? 5 : 3, fill: color }));
  }
  box.replaceChildren(...parts);
}

const PALETTE = ["#1f5fd1", "#0a7a2f", "#b3261e", "#8a4fbf", "#c77800", "#00838f"];

// What served over time: every decision of the gate, a dot if promoted (the line joins them), a
// cross if refused, its rule in the cross's title.
function served(decisions) {
  const box = $("served"), W = 640, H = 200, P = 34;
  const ds = decisions.filter((d) => num(d.at) !== null && num(d.result) !== null);
  if (!ds.length) {
    const t = svg("text", { x: 10, y: 20, fill: "#777" });
    t.textContent = "no round put to the gate yet";
    box.replaceChildren(t);
  } else {
    const t0 = Math.min(...ds.map((d) => d.at)), t1 = Math.max(...ds.map((d) => d.at), t0 + 1);
    const X = (t) => P + (W - 2 * P) * (t - t0) / (t1 - t0), Y = (v) => H - P - (H - 2 * P) * v / 100;
    const papers = [...new Set(ds.map((d) => String(d.paper)))];
    const color = (d) => PALETTE[papers.indexOf(String(d.paper)) % PALETTE.length];
    const parts = [svg("line", { x1: P, y1: H - P, x2: W - P, y2: H - P, stroke: "#999" }),
      svg("line", { x1: P, y1: P, x2: P, y2: H - P, stroke: "#999" })];
    const label = (x, y, s) => { const t = svg("text", { x, y, "font-size": 11 }); t.textContent = s; return t; };
    parts.push(label(2, P + 4, "100%"), label(8, H - P, "0%"),
      label(P, H - 8, new Date(t0 * 1000).toLocaleString()), label(W - P - 130, H - 8, new Date(t1 * 1000).toLocaleString()));
    const promoted = ds.filter((d) => d.promoted === true);
    parts.push(svg("polyline", { fill: "none", stroke: "#999", "stroke-width": 1.5,
      points: promoted.map((d) => X(d.at) + "," + Y(d.result)).join(" ") }));
    for (const d of ds) {
      const x = X(d.at), y = Y(d.result), c = color(d);
      const mark = d.promoted === true ? svg("circle", { cx: x, cy: y, r: 5, fill: c })
        : svg("path", { d: `M${x - 4},${y - 4}L${x + 4},${y + 4}M${x - 4},${y + 4}L${x + 4},${y - 4}`, stroke: c, "stroke-width": 2 });
      const title = svg("title");
      title.textContent = `${d.round} on ${d.paper}: ${fmt(d.result)}% · ` + (d.promoted === true ? "promoted" : "refused: " + d.why);
      mark.append(title);
      parts.push(mark);
    }
    box.replaceChildren(...parts);
  }
  $("decisions").tBodies[0].replaceChildren(...decisions.slice(-12).reverse().map((d) => el("tr", {},
    el("td", {}, num(d.at) === null ? "–" : new Date(d.at * 1000).toLocaleString()), el("td", {}, d.round),
    el("td", {}, d.paper), el("td", {}, fmt(d.result)),
    el("td", { class: d.promoted === true ? "beat" : "lost" }, d.promoted === true ? "promoted" : "refused"),
    el("td", {}, d.by), el("td", {}, d.promoted === true ? "" : d.why))));
}

function servedTools(tools) {
  const rows = Object.entries(tools).map(([t, v]) => {
    const row = v && typeof v === "object" ? v : {};
    return el("tr", {}, el("td", {}, t), el("td", {}, row.now ?? "–"), el("td", {}, row.before ?? "–"));
  });
  $("served-tools").tBodies[0].replaceChildren(...(rows.length ? rows :
    [el("tr", {}, el("td", { colspan: 3, class: "muted" }, "nothing serves yet, or it reported no table"))]));
}

function button(label, action) {
  const b = el("button", {}, label);
  b.addEventListener("click", async () => {
    try { await action(); refresh(); } catch (e) { say(label + " refused: " + e.message); }
  });
  return b;
}

async function detail(id) {
  const r = await api("/v1/training/rounds/" + encodeURIComponent(id));
  $("detail").hidden = false;
  $("dtitle").textContent = `${r.id} · ${r.status}` + (r.why ? ` (${r.why})` : "") +
    ` · baseline ${fmt(r.baseline)} → result ${fmt(r.result)}`;
  const path = "/v1/training/rounds/" + encodeURIComponent(id);
  $("actions").replaceChildren(...(owner ? [
    button("stop", () => api(path + "/stop", { method: "POST" })),
    button("promote", () => api(path + "/promote", { method: "POST" })),
  ] : []));
  curve(Array.isArray(r.checks) ? r.checks : []);
  const p = r.paired && typeof r.paired === "object" ? r.paired : null;
  const fell = Array.isArray(r.fell) ? r.fell : [];
  $("paired").textContent = p
    ? `paired on ${num(p.only_after) + num(p.only_before) + num(p.both) + num(p.neither)} turns: ` +
      `${num(p.only_after)} only the new adapter got right, ${num(p.only_before)} only the start; ` +
      `exact McNemar p = ${num(p.p_value) === null ? "–" : num(p.p_value).toPrecision(3)}` +
      (fell.length ? ` · fell: ${fell.map((f) => String(f.tool)).join(", ")}` : "")
    : "no per-turn marks for both exams: not paired";
  const nt = r.end_body && typeof r.end_body.newTools === "object" && r.end_body.newTools ? r.end_body.newTools : null;
  $("newtools").textContent = nt && Array.isArray(nt.tools) && nt.tools.length
    ? `new tools (never in its slice: ${nt.tools.map(String).join(", ")}; ${num(nt.asked) ?? "–"} turns): ` +
      `${fmt(nt.before_pct)}% before → ${fmt(nt.after_pct)}% after`
    : "";
  const fallen = new Set(fell.map((f) => String(f.tool)));
  const tools = r.end_body && typeof r.end_body.perTool === "object" && r.end_body.perTool ? r.end_body.perTool : {};
  const rows = Object.entries(tools).map(([t, v]) => {
    const row = v && typeof v === "object" ? v : {};
    return el("tr", fallen.has(t) ? { class: "lost" } : {}, el("td", {}, t), el("td", {}, row.asked ?? "–"),
      el("td", {}, row.before ?? "–"), el("td", {}, row.after ?? "–"));
  });
  $("tools").tBodies[0].replaceChildren(...(rows.length ? rows :
    [el("tr", {}, el("td", { colspan: 4, class: "muted" }, "reported when the round ends"))]));
  const box = $("notes"), atEnd = box.scrollTop + box.clientHeight >= box.scrollHeight - 5;
  box.textContent = r.notes.map((n) => new Date(n.at * 1000).toLocaleTimeString() + "  " + n.line).join("\n");
  if (atEnd) box.scrollTop = box.scrollHeight;
}

refresh();
setInterval(refresh, 3000);
