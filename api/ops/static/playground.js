// Playground: chat with a model, streamed token by token, or sent as a job whose events
// are shown as they arrive. Each answer shows its TTFT, tokens/s and finish reason.

import { auth, el, getJson, ms, request, sseMessages } from "/console/api.js";

const $ = (id) => document.getElementById(id);
const history = [];
let running = null; // the AbortController of the answer in progress

export function initPlayground() {
  $("pg-form").addEventListener("submit", (event) => { event.preventDefault(); send(); });
  $("pg-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); send(); }
  });
  $("pg-stop-button").addEventListener("click", () => running && running.abort());
  $("pg-clear").addEventListener("click", () => { history.length = 0; $("pg-log").replaceChildren(); });
}

export async function loadModels() {
  if (!auth.ready) return;
  const select = $("pg-model");
  const { data } = await getJson("/v1/models");
  const chosen = select.value;
  select.replaceChildren(...data.map((m) => el("option", { value: m.id }, m.id)));
  if (data.some((m) => m.id === chosen)) select.value = chosen;
  if (!data.length) select.append(el("option", { value: "" }, "no worker is serving a model"));
}

function numberField(id) {
  const raw = $(id).value.trim();
  return raw === "" ? null : Number(raw);
}

function requestBody() {
  const system = $("pg-system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...history] : [...history];
  const body = {
    model: $("pg-model").value || undefined,
    messages,
    temperature: numberField("pg-temperature"),
    top_p: numberField("pg-top-p"),
    max_tokens: numberField("pg-max-tokens"),
  };
  const topK = numberField("pg-top-k");
  if (topK) body.top_k = topK;
  const seed = numberField("pg-seed");
  if (seed !== null) body.seed = seed;
  const stop = $("pg-stop").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stop.length) body.stop = stop;
  for (const name of Object.keys(body)) if (body[name] === null) delete body[name];
  return body;
}

function bubble(role, text) {
  const node = el("div", { class: `msg ${role}`, dataset: { role } },
    el("div", { class: "who" }, role), el("div", { class: "text" }, text));
  $("pg-log").append(node);
  node.scrollIntoView({ block: "end" });
  return node;
}

async function send() {
  const text = $("pg-input").value.trim();
  if (!text || running) return;
  $("pg-input").value = "";
  history.push({ role: "user", content: text });
  bubble("user", text);
  const answer = new Answer(bubble("assistant", ""));
  running = new AbortController();
  setBusy(true);
  try {
    const body = requestBody();
    if ($("pg-as-job").checked) await runJob(body, answer, running.signal);
    else await runStream(body, answer, running.signal);
    history.push({ role: "assistant", content: answer.text });
  } catch (error) {
    answer.fail(error.name === "AbortError" ? "stopped" : error.message);
    history.pop();
  } finally {
    running = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("pg-send").disabled = busy;
  $("pg-stop-button").hidden = !busy;
}

/** One assistant answer being written: its text, timing and closing line. */
class Answer {
  constructor(node) {
    this.node = node;
    this.textNode = node.querySelector(".text");
    this.text = "";
    this.sentAt = performance.now();
    this.firstAt = null;
    this.events = null;
  }
  append(piece) {
    if (!piece) return;
    if (this.firstAt === null) this.firstAt = performance.now();
    this.text += piece;
    this.textNode.textContent = this.text;
    this.node.scrollIntoView({ block: "end" });
  }
  reset() { this.text = ""; this.textNode.textContent = ""; }
  finish(finishReason, usage, jobId) {
    const end = performance.now();
    const tokens = usage ? usage.completion_tokens : null;
    const decodeMs = this.firstAt === null ? 0 : end - this.firstAt;
    const rate = tokens > 1 && decodeMs > 0 ? ((tokens - 1) * 1000) / decodeMs : null;
    const parts = [
      `TTFT ${this.firstAt === null ? "–" : ms((this.firstAt - this.sentAt) / 1000)}`,
      `${rate === null ? "–" : rate.toFixed(1)} tok/s`,
      `${tokens ?? "–"} tokens`,
      `finish: ${finishReason || "–"}`,
    ];
    if (jobId) parts.push(jobId);
    this.node.append(el("div", { class: "stats", dataset: { finish: finishReason || "" } }, parts.join(" · ")));
  }
  fail(message) {
    this.node.classList.add("failed");
    this.node.append(el("div", { class: "stats error" }, message));
  }
  logEvent(kind, detail) {
    if (!this.events) { this.events = el("ol", { class: "events" }); this.node.append(this.events); }
    const last = this.events.lastElementChild;
    if (kind === "delta" && last && last.dataset.kind === "delta") {
      last.dataset.count = Number(last.dataset.count) + 1;
      last.textContent = `delta ×${last.dataset.count}`;
      return;
    }
    this.events.append(el("li", { dataset: { kind, count: 1 } }, kind === "delta" ? "delta ×1" : `${kind} ${detail}`));
  }
}

async function runStream(body, answer, signal) {
  const payload = { ...body, stream: true, stream_options: { include_usage: true } };
  const response = await request("/v1/chat/completions", { method: "POST", body: payload, signal });
  const jobId = response.headers.get("X-Job-Id");
  let finishReason = null;
  let usage = null;
  for await (const message of sseMessages(response)) {
    if (message.data === "[DONE]") break;
    const chunk = JSON.parse(message.data);
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      answer.append(choice.delta && choice.delta.content);
      finishReason = choice.finish_reason || finishReason;
    }
  }
  answer.finish(finishReason, usage, jobId);
}

async function runJob(body, answer, signal) {
  const job = await getJson("/v1/jobs", {
    method: "POST", body: { url: "/v1/chat/completions", body }, signal,
  });
  answer.logEvent("submitted", job.id);
  const response = await request(`/v1/jobs/${job.id}/events`, { signal });
  for await (const message of sseMessages(response)) {
    const event = JSON.parse(message.data);
    if (event.type === "delta") answer.append(event.text);
    if (event.type === "restart") answer.reset();
    answer.logEvent(event.type, eventDetail(event));
    if (event.type === "error") throw new Error(event.message);
    if (event.type === "done") {
      answer.finish(event.choices[0] && event.choices[0].finish_reason, event.usage, job.id);
      return;
    }
  }
}

function eventDetail(event) {
  if (event.type === "started") return `on ${event.worker_id} (attempt ${event.attempt}, ${event.prompt_tokens} prompt tokens)`;
  if (event.type === "restart") return `attempt ${event.attempt}: ${event.reason}`;
  if (event.type === "done") return `${event.usage.completion_tokens} tokens`;
  return "";
}
