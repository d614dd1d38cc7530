// kvflow's status page: polls the status API (docs/observe.md) and draws it. Every value is
// written with textContent (pod names and LoRA adapters come from the pods: never HTML).
"use strict";

const API = "/v1/kvflow/status";
const INTERVAL_MS = Number(new URLSearchParams(location.search).get("interval") || 1000);
const WINDOW = 300; // points kept per plot (5 minutes at 1 s)
const COLORS = ["#2f81f7", "#d1242f", "#1a7f37", "#9a6700", "#8250df", "#bf3989", "#0969da", "#57606a"];

let previous = null; // the last document: rates and means are differences of two
const series = { t: [], pods: [], ttft: {}, itl: {}, rate: {} };
const plots = {};

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  return node;
}

function fmt(v, digits = 0, unit = "") {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  return Number(v).toFixed(digits) + unit;
}

function pct(v) { return v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %"; }

function table(headers, rows) {
  const t = el("table", {}, el("tr", {}, ...headers.map((h) => el("th", {}, h))));
  for (const row of rows) t.append(row);
  return t;
}

function cell(value, cls) { return el("td", cls ? { class: cls } : {}, value); }

// Per pod, over the interval between two documents: requests/s, mean TTFT and ITL (ms).
function deltas(doc) {
  const out = {};
  if (!previous) return out;
  const dt = doc.time - previous.time;
  const before = {};
  for (const m of previous.models) for (const p of m.pods) if (p.served) before[m.model + "|" + p.id] = p.served;
  for (const m of doc.models) {
    for (const p of m.pods) {
      const a = before[m.model + "|" + p.id], b = p.served;
      if (!a || !b || dt <= 0) continue;
      const n = b.ttft_count - a.ttft_count, g = b.itl_count - a.itl_count;
      out[p.id] = {
        rate: (b.requests - a.requests) / dt,
        ttft: n > 0 ? (1000 * (b.ttft_sum_s - a.ttft_sum_s)) / n : null,
        itl: g > 0 ? (1000 * (b.itl_sum_s - a.itl_sum_s)) / g : null,
      };
    }
  }
  return out;
}

function podRow(p, d) {
  const health = p.healthy === null ? "–" : p.healthy ? "healthy" : "unhealthy";
  const kv = p.kv_events;
  return el("tr", { "data-pod": p.id },
    cell(p.id), cell(p.role), cell(health, p.healthy === false ? "bad" : "ok"),
    cell(fmt(p.in_flight), "num"), cell(fmt(p.running), "num"), cell(fmt(p.waiting), "num"),
    cell(pct(p.kv_usage), "num"), cell(pct(p.prefix_hit_rate), "num"), cell((p.loras || []).join(", ") || "–"),
    cell(fmt(p.last_scrape_s, 1, " s"), "num"),
    cell(kv ? fmt(kv.lag_s === null ? null : kv.lag_s * 1000, 1, " ms") : "–", "num"),
    cell(p.served ? fmt(p.served.requests) : "–", "num", ),
    cell(d ? fmt(d.rate, 2) : "–", "num"), cell(d ? fmt(d.ttft, 1) : "–", "num"), cell(d ? fmt(d.itl, 2) : "–", "num"));
}

function decisionRow(d) {
  const when = d.time ? new Date(d.time * 1000).toLocaleTimeString() : "";
  const scores = el("details", {}, el("summary", {}, d.candidates.length + " candidates"),
    table(["leg", "pod", "role", "total", "scores"], d.candidates.map((c) => el("tr", {},
      cell(c.leg), cell(c.id + (c.picked ? " ✔" : "")), cell(c.role), cell(fmt(c.total, 3), "num"),
      cell(Object.entries(c.scores).map(([k, v]) => k + " " + v.toFixed(2)).join(", "))))));
  return el("tr", { class: "decision" },
    cell(when), cell(d.request_id), cell(d.mode || "error"), cell(d.pick || "–"), cell(d.prefill || "–"),
    cell(fmt(d.cached_tokens) + " / " + fmt(d.prompt_tokens), "num"), cell(fmt(d.micros, 0, " µs"), "num"),
    el("td", { class: "reason" }, d.reason, scores));
}

function renderModels(doc, perPod) {
  const root = document.getElementById("models");
  root.replaceChildren();
  for (const m of doc.models) {
    const pd = m.pd ? (m.pd.enabled ? "P/D over " + m.pd.threshold + " uncached tokens" : "P/D off") : "";
    const adm = m.admission ? "in flight " + m.admission.in_flight + ", queued " + m.admission.queued : "";
    root.append(el("h2", { class: "model" }, "Model " + m.model),
      el("div", { class: "meta" }, ["profile " + (m.profile || "–"), pd, adm,
        m.loras.length ? "LoRA " + m.loras.join(", ") : ""].filter(Boolean).join(" · ")));
    root.append(el("h3", {}, "Pods"), table(
      ["pod", "role", "health", "in flight", "running", "waiting", "KV cache", "prefix hit", "LoRA",
        "last scrape", "KV-event lag", "served", "req/s", "TTFT ms", "ITL ms"],
      m.pods.map((p) => podRow(p, perPod[p.id]))));
    root.append(el("h3", {}, "Last decisions"), table(
      ["time", "request", "mode", "pod", "prefill", "cached / prompt", "took", "why"],
      m.decisions.slice(0, 10).map(decisionRow)));
  }
}

function renderBatches(doc) {
  const root = document.getElementById("batches");
  if (!doc.batches.length) { root.replaceChildren(el("p", { class: "meta" }, "no batch running")); return; }
  root.replaceChildren(table(["batch", "status", "endpoint", "progress", "done", "failed", "total"],
    doc.batches.map((b) => {
      const share = b.total ? (b.completed + b.failed) / b.total : 0;
      const bar = el("span", { class: "bar" }, el("span", { style: "width:" + (100 * share).toFixed(1) + "%" }));
      return el("tr", {}, cell(b.id), cell(b.status), cell(b.endpoint), el("td", {}, bar),
        cell(b.completed, "num"), cell(b.failed, "num"), cell(b.total, "num"));
    })));
}

function plot(id, title, key, unit) {
  const pods = series.pods;
  const data = [series.t, ...pods.map((p) => series[key][p])];
  const existing = plots[id];
  if (existing && existing.pods === pods.join(",")) { existing.chart.setData(data); return; }
  if (existing) existing.chart.destroy();
  const opts = {
    title, width: 420, height: 220,
    scales: { x: { time: true } },
    axes: [{}, { label: unit, size: 60 }],
    series: [{}, ...pods.map((p, i) => ({ label: p, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true }))],
  };
  plots[id] = { pods: pods.join(","), chart: new uPlot(opts, data, document.getElementById(id)) };
}

function record(doc, perPod) {
  const pods = [...new Set(doc.models.flatMap((m) => m.pods.map((p) => p.id)))];
  if (pods.join(",") !== series.pods.join(",")) {
    for (const key of ["ttft", "itl", "rate"]) {
      const kept = {};
      for (const p of pods) kept[p] = series[key][p] || series.t.map(() => null);
      series[key] = kept;
    }
    series.pods = pods;
  }
  series.t.push(doc.time);
  for (const p of pods) {
    const d = perPod[p];
    series.ttft[p].push(d ? d.ttft : null);
    series.itl[p].push(d ? d.itl : null);
    series.rate[p].push(d ? d.rate : null);
  }
  if (series.t.length > WINDOW) {
    series.t.shift();
    for (const key of ["ttft", "itl", "rate"]) for (const p of pods) series[key][p].shift();
  }
  plot("plot-ttft", "Time to first token", "ttft", "ms");
  plot("plot-itl", "Inter-token latency", "itl", "ms");
  plot("plot-rate", "Requests per second", "rate", "req/s");
}

async function tick() {
  try {
    const resp = await fetch(API, { credentials: "same-origin", cache: "no-store" });
    const body = await resp.json();
    if (!resp.ok) throw new Error((body.error && body.error.message) || "HTTP " + resp.status);
    const perPod = deltas(body);
    document.getElementById("source").textContent = "served by the " + body.source;
    document.getElementById("updated").textContent = "updated " + new Date(body.time * 1000).toLocaleTimeString();
    document.getElementById("error").textContent = "";
    renderModels(body, perPod);
    renderBatches(body);
    record(body, perPod);
    previous = body;
  } catch (err) {
    document.getElementById("error").textContent = "status API: " + err.message;
  } finally {
    setTimeout(tick, INTERVAL_MS);
  }
}

tick();
