// The page of `aiayn serve`: translate, and show the attention of the first line. No external URL, no
// inline script (Content-Security-Policy: default-src 'self'); text goes in with textContent only.
"use strict";

const $ = (id) => document.getElementById(id);
let attention = null; // the last /attention answer

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function call(path, body) {
  const response = await fetch(path, body === undefined
    ? { headers: headers() }
    : { method: "POST", headers: headers(), body: JSON.stringify(body) });
  let payload = null;
  try {
    payload = await response.json();
  } catch (e) {
    payload = null;
  }
  if (!response.ok) {
    const error = payload && payload.error ? payload.error : { type: "http_error", message: response.statusText };
    throw new Error(`${response.status} ${error.type}: ${error.message}`);
  }
  return { payload, response };
}

function showError(message) {
  const box = $("error");
  box.textContent = message || "";
  box.hidden = !message;
}

function option(select, value, text) {
  const o = document.createElement("option");
  o.value = String(value);
  o.textContent = text;
  select.appendChild(o);
}

let models = []; // /info's models: what each translates, its shape and search

// what a request says of its model: the languages the selector names (a model may write several), or the
// model's name where its languages are unknown
function chosen() {
  const value = $("pair").value;
  return value ? JSON.parse(value) : {};
}

function modelOf(choice) {
  return models.find((m) => m.name === choice.name) || models[0];
}

function describeModel() {
  const m = modelOf(chosen());
  if (!m) return;
  const shape = m.model;
  $("model-info").textContent =
    `${m.name}: ${shape.n_encoder_layers}+${shape.n_decoder_layers} layers, d_model ${shape.d_model}, ` +
    `${shape.n_heads} heads, ${m.state}`;
}

async function loadInfo() {
  try {
    const { payload } = await call("/info");
    models = payload.models;
    const pair = $("pair");
    pair.textContent = "";
    for (const m of models) {
      if (!m.languages) {
        option(pair, JSON.stringify({ name: m.name, model: m.name }), m.name);
        continue;
      }
      for (const s of m.languages.source) {
        for (const t of m.languages.target) {
          if (s !== t) option(pair, JSON.stringify({ name: m.name, source: s, target: t }), `${s} → ${t} (${m.name})`);
        }
      }
    }
    describeModel();
    const beam = $("beam");
    beam.textContent = "";
    for (let b = 1; b <= payload.limits.max_beam; b++) option(beam, b, b === 1 ? "1 (greedy)" : String(b));
    beam.value = String(modelOf(chosen()).search.beam_size);
    $("model-info").textContent += `; ${payload.device} ${payload.dtype}, engine ${payload.engine}`;
  } catch (e) {
    showError(e.message);
  }
}

function withModel(body) {
  const choice = chosen();
  if (choice.model) body.model = choice.model;
  if (choice.source) Object.assign(body, { source: choice.source, target: choice.target });
  return body;
}

async function translate() {
  const text = $("source").value;
  showError("");
  if (!text.trim()) return;
  const button = $("translate");
  button.disabled = true;
  const started = performance.now();
  try {
    const body = withModel({ text: text });
    if ($("beam").value) body.beam_size = Number($("beam").value);
    const { payload, response } = await call("/translate", body);
    const ms = Math.round(performance.now() - started);
    $("translation").textContent = payload.translations[0];
    $("latency").textContent = `${ms} ms, batch of ${response.headers.get("X-Batch-Size") || "?"}`;
    const first = text.split("\n").find((line) => line.trim());
    const att = await call("/attention", withModel({ text: first }));
    attention = att.payload;
    fillLayers();
    draw();
    $("download").disabled = false;
  } catch (e) {
    showError(e.message);
    // no stale answer under the error: the translation shown is never of another text
    for (const id of ["translation", "latency"]) $(id).textContent = "";
  } finally {
    button.disabled = false;
  }
}

function fillLayers() {
  const kind = $("kind").value;
  const layers = attention[kind];
  const layer = $("layer"), head = $("head");
  const keepLayer = layer.value, keepHead = head.value;
  layer.textContent = "";
  layers.forEach((_, i) => option(layer, i, String(i + 1)));
  head.textContent = "";
  option(head, "mean", "mean of heads");
  layers[0].forEach((_, h) => option(head, h, String(h + 1)));
  if (keepLayer && Number(keepLayer) < layers.length) layer.value = keepLayer;
  else layer.value = String(layers.length - 1);
  if (keepHead && (keepHead === "mean" || Number(keepHead) < layers[0].length)) head.value = keepHead;
}

function matrix() {
  const heads = attention[$("kind").value][Number($("layer").value)];
  const head = $("head").value;
  if (head !== "mean") return heads[Number(head)];
  return heads[0].map((row, i) => row.map((_, j) => heads.reduce((sum, h) => sum + h[i][j], 0) / heads.length));
}

function labels() {
  const kind = $("kind").value;
  const src = attention.source_tokens, tgt = attention.target_tokens;
  if (kind === "encoder") return { rows: src, cols: src };
  if (kind === "decoder") return { rows: tgt, cols: tgt };
  return { rows: tgt, cols: src };
}

function colour(w) { // white to deep blue
  const t = Math.max(0, Math.min(1, w));
  const r = Math.round(255 - 215 * t), g = Math.round(255 - 185 * t), b = Math.round(255 - 80 * t);
  return `rgb(${r}, ${g}, ${b})`;
}

function draw() {
  const table = $("heatmap");
  table.textContent = "";
  if (!attention) return;
  const weights = matrix();
  const { rows, cols } = labels();
  const head = document.createElement("thead");
  const top = document.createElement("tr");
  top.appendChild(document.createElement("th"));
  for (const c of cols) {
    const th = document.createElement("th");
    th.textContent = c;
    top.appendChild(th);
  }
  head.appendChild(top);
  table.appendChild(head);
  const body = document.createElement("tbody");
  weights.forEach((row, i) => {
    const tr = document.createElement("tr");
    const th = document.createElement("th");
    th.textContent = rows[i];
    tr.appendChild(th);
    row.forEach((w, j) => {
      const td = document.createElement("td");
      td.className = "cell";
      td.dataset.query = String(i);
      td.dataset.key = String(j);
      td.dataset.weight = String(w);
      td.style.backgroundColor = colour(w);
      tr.appendChild(td);
    });
    body.appendChild(tr);
  });
  table.appendChild(body);
}

function tooltip(event) {
  const tip = $("tooltip");
  const cell = event.target.closest("td.cell");
  if (!cell) {
    tip.hidden = true;
    return;
  }
  const { rows, cols } = labels();
  const w = Number(cell.dataset.weight);
  tip.textContent = `${rows[Number(cell.dataset.query)]} \u2192 ${cols[Number(cell.dataset.key)]}: ${w.toFixed(3)}`;
  tip.style.left = `${event.clientX + 12}px`;
  tip.style.top = `${event.clientY + 12}px`;
  tip.hidden = false;
}

function download() {
  if (!attention) return;
  const blob = new Blob([JSON.stringify(attention)], { type: "application/json" });
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = "attention.json";
  document.body.appendChild(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);  // revoked at once, some browsers cancel it
}

document.addEventListener("DOMContentLoaded", () => {
  $("translate").addEventListener("click", translate);
  $("source").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      translate();
    }
  });
  $("pair").addEventListener("change", describeModel);
  $("kind").addEventListener("change", () => { if (attention) { fillLayers(); draw(); } });
  $("layer").addEventListener("change", draw);
  $("head").addEventListener("change", draw);
  $("download").addEventListener("click", download);
  $("heatmap").addEventListener("mousemove", tooltip);
  $("heatmap").addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
  $("api-key").addEventListener("change", loadInfo);
  loadInfo();
});
