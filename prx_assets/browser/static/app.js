// The curation browser page. Everything from the lab (captions, sources, batch names) is
// untrusted text: it only ever reaches the page through textContent, never innerHTML.
"use strict";

const KEY_RE = /^[0-9a-f]{64}$/;
const LIST_FILTERS = ["batch", "source", "label", "tier", "shape", "skip", "snapshot"];
const NUMBER_FILTERS = ["min_side", "max_side", "min_mp", "max_mp"];
let lastQuery = null; // {kind: "search"|"similar", key?}
// Each request gets the next number; a response that is not the latest one's is dropped, so
// a slow earlier answer never replaces the cards of a later query or audit.
let querySeq = 0;
let detailSeq = 0;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(typeof child === "string" ? document.createTextNode(child) : child);
  }
  return node;
}

function setStatus(text, isError) {
  const status = document.getElementById("status");
  status.textContent = text;
  status.classList.toggle("error", Boolean(isError));
}

async function getJSON(url) {
  const response = await fetch(url, { headers: { Accept: "application/json" } });
  let payload = null;
  try { payload = await response.json(); } catch (e) { payload = null; }
  if (!response.ok) {
    throw new Error(payload && payload.error ? payload.error : `HTTP ${response.status}`);
  }
  return payload;
}

function thumbUrl(key, size) {
  return `/api/image/${encodeURIComponent(key)}/thumb?size=${size}`;
}

// ---------------------------------------------------------------- filters

function buildFilters(facets) {
  const values = {
    batch: facets.batches, source: facets.sources, label: facets.labels,
    tier: facets.tiers, shape: facets.shapes, skip: facets.skip, snapshot: facets.snapshots,
  };
  for (const name of LIST_FILTERS) {
    const fieldset = document.querySelector(`fieldset[data-filter="${name}"]`);
    const box = fieldset.querySelector(".options");
    box.replaceChildren();
    for (const value of values[name] || []) {
      const input = el("input", { type: "checkbox", name, value: String(value) });
      input.addEventListener("change", rerun);
      box.append(el("label", { title: String(value) }, input, " ", String(value)));
    }
    if (!(values[name] || []).length && !facets.disabled[name]) {
      box.append(el("p", { class: "note", text: "no values yet" }));
    }
    disableWithNote(fieldset, facets.disabled[name]);
  }
  disableWithNote(document.querySelector('fieldset[data-filter="resolution"]'),
    facets.disabled.min_side);
  for (const name of NUMBER_FILTERS) {
    document.getElementById(name).addEventListener("change", rerun);
  }
  if (facets.disabled.q) {
    document.getElementById("q").disabled = true;
    document.getElementById("q").placeholder = facets.disabled.q;
  }
}

function disableWithNote(fieldset, note) {
  fieldset.querySelectorAll(".note.disabled-note").forEach((n) => n.remove());
  fieldset.disabled = Boolean(note);
  if (note) fieldset.append(el("p", { class: "note disabled-note", text: `Unavailable: ${note}` }));
}

function filterParams() {
  const params = new URLSearchParams();
  for (const name of LIST_FILTERS) {
    const fieldset = document.querySelector(`fieldset[data-filter="${name}"]`);
    if (fieldset.disabled) continue;
    fieldset.querySelectorAll("input:checked").forEach((i) => params.append(name, i.value));
  }
  if (!document.querySelector('fieldset[data-filter="resolution"]').disabled) {
    for (const name of NUMBER_FILTERS) {
      const value = document.getElementById(name).value.trim();
      if (value) params.set(name, value);
    }
  }
  return params;
}

// ---------------------------------------------------------------- results

function renderSteps(steps) {
  const body = document.querySelector("#steps tbody");
  body.replaceChildren();
  for (const step of steps || []) {
    body.append(el("tr", {},
      el("td", { text: step.table }), el("td", { text: step.purpose }),
      el("td", { text: String(step.rows) }), el("td", { text: step.ms.toFixed(1) }),
      el("td", { text: (step.uses || []).join(", ") || "scan" })));
  }
}

function card(hit, reference) {
  const img = el("img", { class: "thumb", alt: "", loading: "lazy", src: thumbUrl(hit.key, 256) });
  const badges = el("p", { class: "meta" });
  if (reference && hit.key === reference) badges.append(el("span", { class: "badge self", text: "this image" }));
  if (hit.label) badges.append(el("span", { class: "badge", text: hit.label }));
  if (hit.tier != null) badges.append(el("span", { class: "badge", text: `tier ${hit.tier} ${hit.shape || ""}` }));
  if (hit.excluded) badges.append(el("span", { class: "badge excluded", text: `skipped: ${(hit.reasons || []).join(", ")}` }));
  if (hit.skip_lags) badges.append(el("span", { class: "badge", text: "skip_audit lags the live skip-lists: rerun skip_lists" }));
  const size = hit.width && hit.height ? `${hit.width}×${hit.height}` : "";
  const score = hit.score != null ? `score ${hit.score.toFixed(2)}`
    : hit.distance != null ? `distance ${hit.distance.toFixed(3)}` : "";
  const meta = el("p", { class: "meta", text: [hit.batch, hit.source, size, score].filter(Boolean).join(" · ") });
  const caption = el("p", { class: "caption", text: hit.caption || "(no caption)" });
  const node = el("div", { class: "card", "data-key": hit.key, tabindex: "0" }, img, caption, badges, meta);
  node.addEventListener("click", () => openDetail(hit.key, node));
  node.addEventListener("keydown", (e) => { if (e.key === "Enter") openDetail(hit.key, node); });
  return node;
}

function renderResults(payload) {
  const box = document.getElementById("results");
  box.replaceChildren(...payload.hits.map((h) => card(h, payload.reference)));
  renderSteps(payload.steps);
  const what = payload.mode === "similar" ? `like ${payload.reference.slice(0, 12)}…`
    : payload.mode === "browse" ? "listing" : "full-text";
  const more = payload.exhausted ? "" : " (more exist: refine the query)";
  setStatus(`${payload.hits.length} results · ${what} · ${payload.ms.toFixed(0)} ms${more}`);
}

function clearResults() {
  // An error leaves no card of an earlier query under it: they would read as its answer.
  document.getElementById("results").replaceChildren();
  renderSteps([]);
}

async function runQuery(url, waiting) {
  const seq = ++querySeq;
  setStatus(waiting);
  try {
    const payload = await getJSON(url);
    if (seq === querySeq) renderResults(payload);
  } catch (err) {
    if (seq === querySeq) {
      clearResults();
      setStatus(err.message, true);
    }
  }
}

async function runSearch() {
  const params = filterParams();
  const q = document.getElementById("q").value.trim();
  if (q) {
    params.set("q", q);
    params.set("match", document.getElementById("match").value);
  }
  lastQuery = { kind: "search" };
  await runQuery(`/api/search?${params}`, "Searching…");
}

async function runSimilar(key) {
  if (!KEY_RE.test(key)) return;
  const params = filterParams();
  params.set("key", key);
  lastQuery = { kind: "similar", key };
  await runQuery(`/api/similar?${params}`, "Finding similar captions…");
}

function rerun() {
  if (lastQuery && lastQuery.kind === "similar") runSimilar(lastQuery.key);
  else runSearch();
}

// ---------------------------------------------------------------- detail + audit

function renderAudit(trail) {
  const box = document.getElementById("audit");
  box.replaceChildren(el("p", { id: "verdict", class: `verdict ${trail.status}`, text: trail.verdict }));
  if (trail.copies.length > 1) {
    const list = el("ul", { class: "copies" });
    for (const c of trail.copies) list.append(el("li", { text: `${c.batch} ${c.key || c.path}: ${c.verdict}` }));
    box.append(list);
  }
  for (const [table, rows] of Object.entries(trail.tables)) {
    const section = el("section", { class: "audit-table", "data-table": table },
      el("h3", { text: `${table} (Lance version ${trail.versions[table]})` }));
    if (!rows.length) section.append(el("p", { class: "note", text: "no rows" }));
    for (const row of rows) {
      const table_ = el("table");
      for (const [column, value] of Object.entries(row)) {
        const text = value === null ? "—" : typeof value === "object" ? JSON.stringify(value) : String(value);
        table_.append(el("tr", {}, el("td", { text: column }), el("td", { text })));
      }
      section.append(table_);
    }
    box.append(section);
  }
}

async function openDetail(key, node) {
  if (!KEY_RE.test(key)) return;
  document.querySelectorAll(".card.selected").forEach((c) => c.classList.remove("selected"));
  if (node) node.classList.add("selected");
  const panel = document.getElementById("detail");
  panel.hidden = false;
  panel.dataset.key = key;
  document.getElementById("preview").src = thumbUrl(key, 1024);
  document.getElementById("detail-key").textContent = key;
  const box = document.getElementById("audit");
  box.replaceChildren(el("p", { text: "Loading audit trail…" }));
  const seq = ++detailSeq;
  try {
    const trail = await getJSON(`/api/audit/${encodeURIComponent(key)}`);
    if (seq === detailSeq) renderAudit(trail);
  } catch (err) {
    if (seq === detailSeq) box.replaceChildren(el("p", { class: "note", text: err.message }));
  }
}

// ---------------------------------------------------------------- start

async function start() {
  document.getElementById("search-form").addEventListener("submit", (e) => {
    e.preventDefault();
    runSearch();
  });
  document.getElementById("clear").addEventListener("click", () => {
    document.getElementById("q").value = "";
    document.querySelectorAll("#filters input[type=checkbox]").forEach((i) => { i.checked = false; });
    NUMBER_FILTERS.forEach((n) => { document.getElementById(n).value = ""; });
    runSearch();
  });
  document.getElementById("close-detail").addEventListener("click", () => {
    document.getElementById("detail").hidden = true;
  });
  document.getElementById("more-like-this").addEventListener("click", () => {
    runSimilar(document.getElementById("detail").dataset.key || "");
  });
  try {
    const facets = await getJSON("/api/facets");
    buildFilters(facets);
    if (facets.disabled.similar) {
      document.getElementById("more-like-this").disabled = true;
      document.getElementById("more-like-this").title = facets.disabled.similar;
    }
  } catch (err) {
    setStatus(`Cannot read the lab: ${err.message}`, true);
    return;
  }
  runSearch();
}

document.addEventListener("DOMContentLoaded", start);
