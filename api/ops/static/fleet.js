// Fleet: one card per live worker (KV blocks as a bar, running, waiting, tokens/s, last
// heartbeat) and the depth of every queue, polled once a second while the view is shown.

import { el, getJson } from "/console/api.js";

const POLL_MS = 1000;
const $ = (id) => document.getElementById(id);

export async function refreshFleet() {
  const [workers, queues] = await Promise.all([getJson("/v1/workers"), getJson("/v1/queues")]);
  renderWorkers(workers.data);
  renderQueues(queues.data);
}

export const FLEET_POLL_MS = POLL_MS;

function renderWorkers(workers) {
  const now = Date.now() / 1000;
  const cards = $("fleet-cards");
  const seen = new Set();
  for (const worker of workers) {
    seen.add(worker.id);
    let card = cards.querySelector(`[data-worker-id="${CSS.escape(worker.id)}"]`);
    if (!card) { card = emptyCard(worker.id); cards.append(card); }
    fillCard(card, worker, now);
  }
  for (const card of [...cards.children]) if (!seen.has(card.dataset.workerId)) card.remove();
  const blocks = workers.reduce((sum, w) => sum + w.kv_blocks_used, 0);
  const total = workers.reduce((sum, w) => sum + w.kv_blocks_total, 0);
  $("fleet-summary").textContent = workers.length
    ? `${workers.length} live · ${blocks}/${total} KV blocks used`
    : "none live: start one with `ladle up` or `python -m worker`";
}

function emptyCard(id) {
  const field = (name, label) => el("div", { class: "field" }, el("span", { class: "muted" }, label), el("b", { dataset: { field: name } }));
  return el("article", { class: "card", dataset: { workerId: id } },
    el("header", {}, el("b", { class: "wid" }, id), el("span", { class: "pill", dataset: { field: "status" } })),
    el("div", { class: "muted", dataset: { field: "model" } }),
    el("div", { class: "kv" },
      el("div", { class: "kv-label" }, el("span", {}, "KV cache"), el("span", { dataset: { field: "kv" } })),
      el("div", { class: "bar" }, el("div", { class: "bar-fill" }))),
    el("div", { class: "fields" },
      field("running", "running"), field("waiting", "waiting"),
      field("tokens_per_s", "tokens/s"), field("heartbeat", "heartbeat")));
}

function fillCard(card, w, now) {
  const set = (name, text) => { card.querySelector(`[data-field="${name}"]`).textContent = text; };
  const ratio = w.kv_blocks_total ? w.kv_blocks_used / w.kv_blocks_total : 0;
  set("status", w.status);
  card.querySelector(".pill").dataset.status = w.status;
  set("model", `${w.model} · ${w.device} · ${w.dtype} · ${w.host}:${w.pid}`);
  set("kv", `${w.kv_blocks_used} / ${w.kv_blocks_total} blocks (${(ratio * 100).toFixed(1)} %)`);
  const fill = card.querySelector(".bar-fill");
  fill.style.width = `${Math.min(100, ratio * 100).toFixed(2)}%`;
  fill.dataset.level = ratio > 0.9 ? "high" : ratio > 0.6 ? "mid" : "low";
  card.dataset.kvUsed = String(w.kv_blocks_used);
  set("running", String(w.running));
  set("waiting", String(w.waiting));
  set("tokens_per_s", (w.tokens_per_s || 0).toFixed(1));
  set("heartbeat", `${Math.max(0, now - w.heartbeat_at).toFixed(1)} s ago`);
}

function renderQueues(queues) {
  $("fleet-queues").replaceChildren(...queues.map((q) => el("tr", { dataset: { model: q.model, lane: q.lane } },
    el("td", {}, q.model), el("td", {}, q.lane),
    el("td", { class: "num" }, String(q.waiting)), el("td", { class: "num" }, String(q.running)))));
}
