// Jobs: the caller's recent jobs (status, attempts, timings), its batches (lines done), and
// one job's detail: its phase timings as a bar, and its event timeline (deltas summarised,
// restarts, the end).

import { clock, el, entryTime, getJson, ms, request, sseMessages } from "/console/api.js";

const $ = (id) => document.getElementById(id);
const PHASES = [
  ["queue", "queued_at", "picked_at"],
  ["setup", "picked_at", "started_at"],
  ["engine queue", "started_at", "scheduled_at"],
  ["prefill", "scheduled_at", "first_token_at"],
  ["decode", "first_token_at", "finished_at"],
];
let selected = null;
let timeline = null; // AbortController of the detail's event stream

export function initJobs() {
  $("jobs-refresh").addEventListener("click", () => refreshJobs());
}

export async function refreshJobs() {
  const [{ data }, batches] = await Promise.all([getJson("/v1/jobs?limit=50"), getJson("/v1/batches?limit=20")]);
  $("jobs-rows").replaceChildren(...(data.length ? data.map(row) : [emptyRow(9, "No jobs yet")]));
  $("batch-rows").replaceChildren(...(batches.data.length ? batches.data.map(batchRow) : [emptyRow(8, "No batches")]));
  const current = data.find((job) => job.id === selected);
  if (current) showSummary(current);
}

function span(timings, from, to) {
  return timings && timings[from] && timings[to] ? timings[to] - timings[from] : null;
}

function row(job) {
  const t = job.timings;
  const tr = el("tr", { dataset: { jobId: job.id }, class: job.id === selected ? "selected" : "" },
    el("td", { class: "mono", title: job.id }, job.id.slice(4, 14) + "…"),
    el("td", {}, clock(job.created_at)),
    el("td", {}, job.model.length > 22 ? job.model.slice(0, 21) + "…" : job.model),
    el("td", {}, el("span", { class: "pill", dataset: { status: job.status } }, job.status)),
    el("td", { class: "num" }, String(job.attempts)),
    el("td", { class: "num" }, ms(span(t, "queued_at", "picked_at") ?? (job.started_at ? job.started_at - job.created_at : null))),
    el("td", { class: "num" }, ms(span(t, "queued_at", "first_token_at"))),
    el("td", { class: "num" }, ms(job.finished_at ? job.finished_at - job.created_at : null)),
    el("td", { class: "num" }, job.usage ? `${job.usage.prompt_tokens} → ${job.usage.completion_tokens}` : "–"));
  tr.addEventListener("click", () => select(job));
  return tr;
}

function emptyRow(columns, text) {
  return el("tr", {}, el("td", { class: "empty", colspan: String(columns) }, text));
}

function batchRow(batch) {
  const counts = batch.request_counts;
  const done = counts.total ? (counts.completed + counts.failed) / counts.total : 0;
  return el("tr", { dataset: { batchId: batch.id } },
    el("td", { class: "mono", title: batch.id }, batch.id.slice(0, 14) + "…"),
    el("td", {}, clock(batch.created_at)),
    el("td", {}, batch.endpoint),
    el("td", {}, el("span", { class: "pill", dataset: { status: batch.status } }, batch.status)),
    el("td", {}, el("div", { class: "bar small" }, el("div", { class: "bar-fill", style: { width: `${(100 * done).toFixed(1)}%` } }))),
    el("td", { class: "num" }, String(counts.completed)),
    el("td", { class: "num" }, String(counts.failed)),
    el("td", { class: "num" }, String(counts.total)));
}

function select(job) {
  selected = job.id;
  for (const tr of $("jobs-rows").children) tr.classList.toggle("selected", tr.dataset.jobId === job.id);
  showSummary(job);
  streamTimeline(job.id);
}

function showSummary(job) {
  const detail = $("job-detail");
  let summary = detail.querySelector(".summary");
  const fresh = el("div", { class: "summary" },
    el("h3", { class: "mono" }, job.id),
    el("p", {}, `${job.status} · ${job.attempts} attempt(s) · worker ${job.worker_id || "–"} · ${job.url}`),
    job.error ? el("p", { class: "error" }, `${job.error.status} ${job.error.type}: ${job.error.message}`) : null,
    phaseBar(job.timings));
  if (summary) summary.replaceWith(fresh);
  else detail.replaceChildren(fresh, el("h4", {}, "Events"), el("ol", { class: "timeline", id: "job-timeline" }));
}

function phaseBar(timings) {
  const phases = PHASES.map(([name, from, to]) => [name, span(timings, from, to)]).filter(([, d]) => d !== null);
  if (!phases.length) return el("p", { class: "muted" }, "Phase timings appear when the job completes.");
  const total = phases.reduce((sum, [, d]) => sum + d, 0) || 1;
  return el("div", { class: "phases" },
    el("div", { class: "phase-bar" }, phases.map(([name, d], i) => el("div", {
      class: `phase p${i}`, title: `${name}: ${ms(d)}`, style: { width: `${Math.max(0.5, (100 * d) / total)}%` },
    }))),
    el("ul", { class: "legend" }, phases.map(([name, d], i) => el("li", {}, el("i", { class: `p${i}` }), `${name} ${ms(d)}`))));
}

async function streamTimeline(jobId) {
  if (timeline) timeline.abort();
  timeline = new AbortController();
  const signal = timeline.signal;
  const list = $("job-timeline");
  let startMs = null;
  let deltas = null;
  try {
    const response = await request(`/v1/jobs/${jobId}/events`, { signal });
    for await (const message of sseMessages(response)) {
      const event = JSON.parse(message.data);
      const at = entryTime(message.id);
      startMs = startMs ?? at;
      const offset = `+${ms((at - startMs) / 1000)}`;
      if (event.type === "delta") {
        deltas = deltas || addItem(list, "delta", offset, "");
        deltas.count = (deltas.count || 0) + 1;
        deltas.tokens = (deltas.tokens || 0) + event.token_ids.length;
        deltas.querySelector(".what").textContent = `${deltas.count} deltas, ${deltas.tokens} tokens (until ${offset})`;
        continue;
      }
      deltas = null;
      addItem(list, event.type, offset, describe(event));
    }
  } catch (error) {
    if (error.name !== "AbortError") addItem(list, "error", "", error.message);
  }
}

function addItem(list, kind, offset, text) {
  const item = el("li", { dataset: { kind } }, el("span", { class: "when mono" }, offset),
    el("b", {}, kind), el("span", { class: "what" }, text));
  list.append(item);
  return item;
}

function describe(event) {
  if (event.type === "started") return `worker ${event.worker_id}, attempt ${event.attempt}, ${event.prompt_tokens} prompt tokens`;
  if (event.type === "restart") return `attempt ${event.attempt}: ${event.reason}`;
  if (event.type === "done") {
    const reasons = event.choices.map((c) => c.finish_reason).join(", ");
    return `${event.usage.completion_tokens} tokens, finish: ${reasons}`;
  }
  if (event.type === "error") return `${event.status} ${event.error_type}: ${event.message}`;
  return "";
}
