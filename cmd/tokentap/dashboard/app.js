// tokentap dashboard: /stats (the numbers) and /stats/timeline (the
// charts), refreshed every 5 s. Every number on the page is a field of
// /stats, shown as it came (rounded for display only where noted).
"use strict";

const state = { window: "5m", charts: {}, token: sessionStorage.getItem("tokentap-token") || "" };
window.tokentap = state; // for tests and the curious: the last answers and the charts

async function get(url) {
  const headers = state.token ? { Authorization: "Bearer " + state.token } : {};
  const r = await fetch(url, { headers, cache: "no-store" });
  if (r.status === 401) {
    document.getElementById("auth").hidden = false;
    throw new Error("unauthorized");
  }
  if (!r.ok) throw new Error(url + ": " + r.status);
  return r.json();
}

function fmt(v, digits) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (digits === undefined) digits = v >= 100 ? 0 : v >= 10 ? 1 : 2;
  return v.toFixed(digits);
}

function pct(v) { return v === null || v === undefined ? "–" : (100 * v).toFixed(1) + "%"; }

// at is a distribution's quantile, "–" where nothing was measured (a route
// of whole responses has no TTFT: never a 0).
function at(d, p) { return d && d.count ? fmt(d[p]) : "–"; }

// noSLO is what the goodput tile says where no request was judged.
const noSLO = "– (no SLO: set slo: {ttft: 500ms} in the config, or -slo ttft=500ms)";

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const k of kids) e.append(k);
  return e;
}

function tile(field, name, text) {
  return el("div", { class: "tile" }, el("div", { class: "name" }, name), el("div", { class: "val", "data-field": field }, text));
}

function routeBox(route) {
  let box = document.querySelector(`.route[data-route="${CSS.escape(route)}"]`);
  if (box) return box;
  box = el("div", { class: "route", "data-route": route },
    el("h2", {}, "route " + route),
    el("div", { class: "tiles" }),
    el("div", { class: "charts" },
      el("div", { class: "chart" }, el("h3", {}, "TTFT (left) and E2E (right), ms"), el("div", { "data-chart": "latency" })),
      el("div", { class: "chart" }, el("h3", {}, "trade-off: output tokens/s against TTFT p95"), el("div", { "data-chart": "tradeoff" })),
      el("div", { class: "chart" }, el("h3", {}, "ITL (ms) and goodput"), el("div", { "data-chart": "itl" }))));
  document.getElementById("routes").append(box);
  return box;
}

function renderTiles(g) {
  const box = routeBox(g.route);
  const tiles = box.querySelector(".tiles");
  const q = (d) => (d.count ? `${fmt(d.p50)} / ${fmt(d.p95)} / ${fmt(d.p99)}` : "–");
  tiles.replaceChildren(
    tile("ttft", "TTFT p50/p95/p99 ms", q(g.ttft_ms)),
    tile("itl", "ITL p50/p95/p99 ms", q(g.itl_ms)),
    tile("e2e", "E2E p50/p95/p99 ms", q(g.e2e_ms)),
    tile("output_tokens_per_s", "output tokens/s", fmt(g.output_tokens_per_s)),
    tile("requests_per_s", "requests/s", fmt(g.requests_per_s)),
    tile("goodput", "goodput", g.goodput.judged ? pct(g.goodput.ratio) + (g.goodput.target ? " (target " + pct(g.goodput.target) + ")" : "") : noSLO),
    tile("queue", "queue p50/p95 ms", `${at(g.queue_ms, "p50")} / ${at(g.queue_ms, "p95")}`),
    tile("overhead", "overhead p50/p95 ms", `${at(g.overhead_ms, "p50")} / ${at(g.overhead_ms, "p95")}`),
    tile("count", "requests (errors, limited, refused)", `${g.count} (${g.errors}, ${g.limited || 0}, ${g.refused || 0})`),
    tile("client_ttft", "client TTFT p50/p95/p99 ms", g.client_ttft_ms.count ? q(g.client_ttft_ms) : "–"));
  let split = box.querySelector(".split");
  if (!split) {
    split = el("p", { class: "split", "data-field": "split" });
    tiles.after(split);
  }
  // The median wait for the first token, split: network (client TTFT −
  // tokentap's TTFT, the round trip) and tokentap's own time.
  split.textContent = g.client_ttft_ms.count && g.ttft_ms.count
    ? `Users waited ${fmt(g.client_ttft_ms.p50)} ms for the first token (p50): ${fmt(Math.max(g.client_ttft_ms.p50 - g.ttft_ms.p50, 0))} in the network, ${fmt(g.overhead_ms.p50)} in tokentap, the rest in the queue (${fmt(g.queue_ms.p50)}) and the backend.`
    : "";
  let panel = box.querySelector(".reading");
  if (!panel) {
    panel = el("div", { class: "reading" });
    split.after(panel);
  }
  renderReading(panel, g.reading);
}

// heldText says where the tokens of the streams whose reader waited were
// held, hop by hop (/stats reading.held_share).
function heldText(rd) {
  const waited = Object.values(rd.held_by).reduce((a, b) => a + b, 0);
  if (!waited) return "where tokens were held: no reader waited";
  return "where tokens were held: " + ["upstream", "gateway", "client"].map((h) => `${h} ${pct(rd.held_share[h] || 0)}`).join(" · ") + ` (of ${waited} streams whose reader waited)`;
}

// renderReading is a route's QoE panel: how its streams read to a reader
// at the route's pace (/stats reading), and a bar of where the tokens
// were held.
function renderReading(panel, rd) {
  if (!rd) {
    panel.replaceChildren(el("p", { class: "sub", "data-field": "qoe" }, "QoE: – (no stream with tokens in the window)"));
    return;
  }
  const bar = el("div", { class: "held-bar" }, ...["upstream", "gateway", "client"].map((h) =>
    el("span", { class: "held-" + h, style: `width: ${(100 * (rd.held_share[h] || 0)).toFixed(1)}%` })));
  panel.replaceChildren(
    el("h3", {}, "how streams read, to a reader at the route's pace"),
    el("div", { class: "tiles" },
      tile("qoe", "QoE p50 / p95 / p99 (low tail)", `${fmt(rd.qoe.p50, 3)} / ${fmt(rd.qoe.p95, 3)} / ${fmt(rd.qoe.p99, 3)}`),
      tile("fluidity", "fluidity p50 / p99", `${fmt(rd.fluidity.p50, 3)} / ${fmt(rd.fluidity.p99, 3)}`),
      tile("stalled", "streams stalled", `${pct(rd.stall_rate)} of ${rd.streams}`),
      tile("stall", "stall ms p95 / p99", `${fmt(rd.stall_ms.p95)} / ${fmt(rd.stall_ms.p99)}`)),
    bar,
    el("p", { class: "sub", "data-field": "held" }, heldText(rd)));
}

function renderWarnings(ws) {
  const box = document.getElementById("warnings");
  if (!ws.length) {
    box.replaceChildren(el("div", { class: "ok" }, "No warnings."));
    return;
  }
  box.replaceChildren(...ws.map((w) => el("div", { class: "warning", "data-kind": w.kind }, el("b", {}, w.kind), w.message)));
}

function renderTable(groups) {
  const body = document.querySelector("#groups tbody");
  body.replaceChildren(...groups.map((g) => el("tr", {},
    ...[g.route, g.model, g.tenant, g.upstream || "–", g.count, g.errors, g.limited || 0, fmt(g.requests_per_s), fmt(g.output_tokens_per_s), pct(g.goodput.ratio),
      at(g.ttft_ms, "p50"), at(g.ttft_ms, "p95"), at(g.ttft_ms, "p99"), at(g.itl_ms, "p50"), at(g.itl_ms, "p95"), at(g.e2e_ms, "p50"), at(g.e2e_ms, "p95"),
      at(g.queue_ms, "p95"), at(g.overhead_ms, "p95")].map((v) => el("td", {}, String(v))))));
}

// renderOverload shows each overload-controlled upstream's gate: what its
// model learned, how well it predicts, what it shed (/stats "overload").
function renderOverload(os) {
  const box = document.getElementById("overload");
  box.hidden = !os || !os.length;
  if (box.hidden) return;
  const body = box.querySelector("tbody");
  body.replaceChildren(...os.map((o) => {
    const mode = !o.enforcing ? "predicting" : o.shedding ? "SHEDDING" : "shedding on";
    const known = (v) => (o.known ? v : "–");
    const cells = [o.route, o.upstream || "–", mode, o.in_flight, known(String(o.limit)),
      known(fmt(o.predicted_ttft_ms) + " ms"), known(o.predicted_tpot_ms >= 0 ? fmt(o.predicted_tpot_ms) + " ms" : "–"),
      o.judged ? (100 * o.abs_error).toFixed(0) + "%" : "–", o.judged ? (o.bias >= 0 ? "+" : "") + (100 * o.bias).toFixed(0) + "%" : "–",
      fmt(o.arrivals_per_s), fmt(o.completions_per_s), o.shed, fmt(o.shed_per_s), pct(o.share) + (o.why ? " (" + Object.entries(o.why).map(([k, n]) => k + " " + n).join(", ") + ")" : ""),
      o.cache_reported ? pct(o.cache_hit_share) : "–",
      (o.ttft_cache_hit_ms >= 0 ? fmt(o.ttft_cache_hit_ms) : "–") + " / " + (o.ttft_cache_miss_ms >= 0 ? fmt(o.ttft_cache_miss_ms) : "–"),
      !o.backend ? "–" : o.backend.error ? o.backend.error : o.backend.running + " running, " + o.backend.waiting + " waiting" +
        (o.backend.kv_cache_usage >= 0 ? ", KV " + (100 * o.backend.kv_cache_usage).toFixed(0) + "%" : "")];
    return el("tr", { "data-route": o.route, class: o.shedding ? "shedding" : "" }, ...cells.map((v, i) => el("td", i === 2 ? { "data-field": "mode" } : {}, String(v))));
  }));
}

// renderCost shows what each group's priced requests cost and how often
// its backend's prompt cache served them (/stats groups).
function renderCost(groups) {
  const rows = (groups || []).filter((g) => g.priced > 0 || g.cache_reported > 0);
  const box = document.getElementById("cost");
  box.hidden = !rows.length;
  if (box.hidden) return;
  box.querySelector("tbody").replaceChildren(...rows.map((g) => el("tr", {},
    ...[g.route, g.model, g.tenant, g.priced, g.cost_usd.toFixed(6), g.cost_per_good_usd != null ? g.cost_per_good_usd.toFixed(6) : "–",
      g.cache_hit_share != null ? pct(g.cache_hit_share) + " of " + g.cache_reported : "–"].map((v) => el("td", {}, String(v))))));
}

const nz = (v, c) => (c > 0 ? v : null); // no requests in a slot: a gap, not a zero

// The newest slot is still open (/stats/timeline marks it partial): its
// requests still in flight are not counted yet, so its rates would read as
// a plunge. Each series stops at the last closed slot, and a dashed copy
// carries it on to the open slot.
function withOpen(points, cols) {
  const n = points.length;
  const open = n > 0 && points[n - 1].partial;
  const out = [points.map((p) => p.t)];
  for (const c of cols) out.push(open ? c.map((v, i) => (i === n - 1 ? null : v)) : c);
  for (const c of cols) out.push(c.map((v, i) => (open && i >= n - 2 ? v : null)));
  return out;
}

function chartData(points) {
  const col = (f) => points.map((p) => nz(p[f], p.count));
  return {
    latency: withOpen(points, [col("ttft_p50_ms"), col("ttft_p95_ms"), col("e2e_p95_ms")]),
    tradeoff: withOpen(points, [points.map((p) => p.output_tokens_per_s), col("ttft_p95_ms")]),
    itl: withOpen(points, [col("itl_p50_ms"), col("itl_p95_ms"), points.map((p) => (p.goodput_ratio === null ? null : 100 * p.goodput_ratio))]),
  };
}

// openSeries adds each series' dashed copy for the open slot.
function openSeries(series) {
  const open = series.slice(1).map((s) => Object.assign({}, s, { label: s.label + " (open slot)", dash: [3, 5], width: 1, class: "open-slot" }));
  return series.concat(open);
}

// fromZero is the range of a scale of times or rates: from 0 to a little
// over the highest value, so that a wiggle of 0.04 ms on 228 ms reads as
// the flat line it is, not as a full swing.
const fromZero = (u, lo, hi) => [0, hi > 0 ? hi * 1.1 : 1];

// xAxis leaves room between time labels (they overlapped at 420 px).
const xAxis = { space: 90 };

const chartOpts = {
  // TTFT and E2E differ by orders of magnitude: each on an axis of its own
  // (TTFT read flat at 0 beside a 6 s E2E).
  latency: {
    series: openSeries([{}, { label: "TTFT p50", stroke: "#3b6fd1", scale: "ttft" }, { label: "TTFT p95", stroke: "#d13b3b", scale: "ttft" },
      { label: "E2E p95", stroke: "#888", scale: "e2e" }]),
    axes: [xAxis, { scale: "ttft", label: "TTFT ms" }, { scale: "e2e", side: 1, label: "E2E ms", grid: { show: false } }],
    scales: { ttft: { range: fromZero }, e2e: { range: fromZero } },
  },
  tradeoff: {
    series: openSeries([{}, { label: "output tokens/s", stroke: "#2a9a4b", scale: "tps" }, { label: "TTFT p95 ms", stroke: "#d13b3b", scale: "ms" }]),
    axes: [xAxis, { scale: "tps", label: "tokens/s" }, { scale: "ms", side: 1, label: "ms", grid: { show: false } }],
    scales: { tps: { range: fromZero }, ms: { range: fromZero } },
  },
  itl: {
    series: openSeries([{}, { label: "ITL p50", stroke: "#3b6fd1", scale: "ms" }, { label: "ITL p95", stroke: "#d13b3b", scale: "ms" }, { label: "goodput %", stroke: "#2a9a4b", scale: "%" }]),
    axes: [xAxis, { scale: "ms", label: "ms" }, { scale: "%", side: 1, label: "%", grid: { show: false } }],
    // Goodput is a share: always 0–100%, so that 99.9% does not read as a cliff.
    scales: { ms: { range: fromZero }, "%": { auto: false, range: [0, 100] } },
  },
};

// The legend names the series; it shows no values (they were "--" on
// every series a slot left empty, and on the open slot's copies).
const legend = { live: false };

function renderCharts(timeline) {
  for (const rt of timeline.routes) {
    const box = routeBox(rt.route);
    const data = chartData(rt.points);
    for (const kind of Object.keys(data)) {
      const id = rt.route + "/" + kind;
      const c = state.charts[id];
      if (c) {
        c.setData(data[kind]);
      } else {
        const o = chartOpts[kind];
        const opts = Object.assign({ width: 420, height: 200, legend }, o, { scales: Object.assign({ x: { time: true } }, o.scales) });
        state.charts[id] = new uPlot(opts, data[kind], box.querySelector(`[data-chart="${kind}"]`));
      }
    }
  }
}

// --- Comparing the upstreams of a route (a canary against its baseline). ---

// compareBox is a route's comparison section, made once.
function compareBox(route) {
  const box = routeBox(route);
  let cmp = box.querySelector(".compare");
  if (cmp) return cmp;
  cmp = el("div", { class: "compare" },
    el("h3", {}, "upstreams compared"),
    el("div", { class: "guard", "data-field": "guard" }),
    el("div", { class: "charts" },
      el("div", { class: "chart" }, el("h3", {}, "TTFT p95 by upstream (ms)"), el("div", { "data-chart": "up-ttft" })),
      el("div", { class: "chart" }, el("h3", {}, "ITL p95 by upstream (ms)"), el("div", { "data-chart": "up-itl" })),
      el("div", { class: "chart" }, el("h3", {}, "E2E p95 by upstream (ms)"), el("div", { "data-chart": "up-e2e" }))),
    // Said at once, before the verdict's first answer.
    el("p", { class: "sub", "data-field": "verdict-head" }, "the verdict on this route's upstreams: weighing…"),
    el("table", { class: "verdict" }, el("thead", {}, el("tr", {},
      ...["measure", "A", "B", "difference (95% interval)", "verdict", "why"].map((h) => el("th", {}, h)))), el("tbody", {})));
  box.append(cmp);
  return cmp;
}

const upColors = ["#3b6fd1", "#d13b3b", "#2a9a4b", "#8a4bd1", "#d19a3b"];

// renderUpstreamCharts draws, per route with several upstreams, each
// upstream's TTFT, ITL and E2E p95 over the last hour.
function renderUpstreamCharts(rt) {
  const cmp = compareBox(rt.route);
  const ups = rt.upstreams;
  for (const [kind, field] of [["up-ttft", "ttft_p95_ms"], ["up-itl", "itl_p95_ms"], ["up-e2e", "e2e_p95_ms"]]) {
    const data = withOpen(ups[0].points, ups.map((u) => u.points.map((p) => nz(p[field], p.count))));
    const id = rt.route + "/" + kind + "/" + ups.map((u) => u.upstream).join(",");
    const c = state.charts[id];
    if (c) {
      c.setData(data);
      continue;
    }
    const series = openSeries([{}, ...ups.map((u, i) => ({ label: u.upstream, stroke: upColors[i % upColors.length] }))]);
    const target = cmp.querySelector(`[data-chart="${kind}"]`);
    target.replaceChildren();
    state.charts[id] = new uPlot({ width: 420, height: 200, legend, series, axes: [xAxis, { label: "ms" }],
      scales: { x: { time: true }, y: { range: fromZero } } }, data, target);
  }
}


function tooFewText(d, c) {
  const need = [];
  if (d.need_a) need.push(`${d.need_a} more on ${c.a}`);
  if (d.need_b) need.push(`${d.need_b} more on ${c.b}`);
  return "too few requests" + (need.length ? " (needs " + need.join(" and ") + ")" : "");
}

function diffText(d) {
  const p = (v) => (v >= 0 ? "+" : "") + (100 * v).toFixed(1) + "%";
  return `${p(d.relative_diff)} (${p(d.ci_low)} … ${p(d.ci_high)})`;
}

// renderVerdict shows /stats?compare: every row with its interval, the
// rows a side has too few requests for, and the classes compared.
function renderVerdict(route, c) {
  const cmp = compareBox(route);
  const cls = (c.classes || []).length > 1 ? `; compared within ${c.classes.length} classes, each weighing the same on both sides` : "";
  const rule = c.sides ? ` (${c.sides})` : "";
  cmp.querySelector('[data-field="verdict-head"]').textContent =
    `A = ${c.a} (${c.count_a} requests), B = ${c.b} (${c.count_b} requests)${rule}, window ${c.window}${cls}. Significance: Holm's method at 5% across the rows.`;
  const rows = [];
  const row = (name, d) => {
    // The same words as tokentap compare: which side does better, and why.
    const verdict = d.too_few ? "" : d.better === "b" ? `${c.b} better` : d.better === "a" ? `${c.b} worse` : "within noise";
    const cls = d.too_few ? "too-few" : d.better === "b" ? "significant better" : d.better === "a" ? "significant worse" : "";
    rows.push(el("tr", { class: cls },
      el("td", {}, name), el("td", {}, fmt(d.a)), el("td", {}, fmt(d.b)),
      el("td", {}, d.too_few ? tooFewText(d, c) : diffText(d)), el("td", {}, verdict), el("td", { class: "why" }, d.why || "")));
  };
  if (c.throughput && c.throughput.name) row("tokens/s per request p50", c.throughput);
  for (const d of c.measures) row(`${d.name.replace(/_ms$/, "")} ${d.quantile}`, d);
  cmp.querySelector(".verdict tbody").replaceChildren(...rows);
}

// renderGuard shows a route's guard: its sides, its looks, and why it
// tripped, with the button that resets it.
function renderGuard(route) {
  const g = (state.guards || []).find((x) => x.route === route);
  const box = compareBox(route).querySelector('[data-field="guard"]');
  if (!g) {
    box.replaceChildren(el("span", { class: "sub" }, "no guard on this route"));
    return;
  }
  const cls = g.class ? ` (class ${g.class})` : "";
  const sidesText = `guard${cls}: ${g.candidate} ${g.candidate_requests} and ${g.baseline} ${g.baseline_requests} requests since it was armed (weighed from ${g.min_requests} a side), ${g.looks} looks; `;
  if (!g.tripped) {
    box.replaceChildren(el("span", { "data-guard": "armed" }, sidesText + "not tripped"));
    return;
  }
  const button = el("button", { "data-action": "reset-guard" }, "reset the guard");
  button.addEventListener("click", () => resetGuard(route, box));
  box.replaceChildren(el("span", { "data-guard": "tripped", class: "tripped" }, sidesText + "TRIPPED: " + g.tripped.reason + " "), button);
}

async function resetGuard(route, box) {
  const headers = state.token ? { Authorization: "Bearer " + state.token } : {};
  const r = await fetch("/-/guard/reset?route=" + encodeURIComponent(route), { method: "POST", headers });
  if (r.status === 401) {
    document.getElementById("auth").hidden = false;
    return;
  }
  state.lastReset = { route, status: r.status, body: await r.text() };
  refresh();
}

async function renderComparisons(timeline) {
  for (const rt of timeline.routes) {
    if (!rt.upstreams || rt.upstreams.length < 2) continue;
    renderUpstreamCharts(rt);
    renderGuard(rt.route);
    // The server picks the sides, by the rule every view follows.
    const w = encodeURIComponent(state.window);
    const url = `/stats?route=${encodeURIComponent(rt.route)}&compare=auto&window=${w}`;
    const headers = state.token ? { Authorization: "Bearer " + state.token } : {};
    const r = await fetch(url, { headers, cache: "no-store" });
    const c = await r.json();
    state.verdicts = state.verdicts || {};
    state.verdicts[rt.route] = c;
    if (r.ok) {
      renderVerdict(rt.route, c);
    } else {
      compareBox(rt.route).querySelector('[data-field="verdict-head"]').textContent = `no verdict yet: ${c.error}`;
    }
  }
}

async function refresh() {
  try {
    const w = encodeURIComponent(state.window);
    const [byRoute, all, timeline, guards] = await Promise.all([
      get(`/stats?window=${w}&group_by=route`),
      get(`/stats?window=${w}`),
      get("/stats/timeline?upstreams"),
      get("/guards"),
    ]);
    state.byRoute = byRoute;
    state.all = all;
    state.timeline = timeline;
    state.guards = guards;
    byRoute.groups.forEach(renderTiles);
    renderWarnings(all.warnings);
    renderTable(all.groups);
    renderOverload(all.overload);
    renderCost(all.groups);
    renderCharts(timeline);
    await renderComparisons(timeline);
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
    state.renders = (state.renders || 0) + 1;
  } catch (e) {
    if (e.message !== "unauthorized") console.warn(String(e) + " " + (e.stack || ""));
  }
}

document.getElementById("window").addEventListener("change", (e) => {
  state.window = e.target.value;
  refresh();
});
document.getElementById("token-go").addEventListener("click", () => {
  state.token = document.getElementById("token").value;
  sessionStorage.setItem("tokentap-token", state.token);
  document.getElementById("auth").hidden = true;
  refresh();
});
refresh();
setInterval(refresh, 5000);
