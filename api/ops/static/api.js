// Talking to Ladle: the API key (session storage only), JSON calls, and SSE over fetch
// (EventSource cannot send an Authorization header).

const KEY = "ladle.apiKey";
const listeners = { unauthorized: [] };

export const auth = {
  required: document.body.dataset.auth === "required",
  get key() { return sessionStorage.getItem(KEY) || ""; },
  set key(value) {
    if (value) sessionStorage.setItem(KEY, value); else sessionStorage.removeItem(KEY);
  },
  get ready() { return !this.required || Boolean(this.key); },
  onUnauthorized(fn) { listeners.unauthorized.push(fn); },
};

export class ApiError extends Error {
  constructor(status, body) {
    const err = (body && body.error) || {};
    super(err.message || `HTTP ${status}`);
    this.status = status;
    this.code = err.code || null;
  }
}

function headers(extra) {
  const out = { ...extra };
  if (auth.key) out.Authorization = `Bearer ${auth.key}`;
  return out;
}

/** fetch() with the key; a non-2xx answer becomes an ApiError (401 asks for a key). */
export async function request(path, { method = "GET", body, signal } = {}) {
  const init = { method, signal, headers: headers(body ? { "Content-Type": "application/json" } : {}) };
  if (body !== undefined) init.body = JSON.stringify(body);
  const response = await fetch(path, init);
  if (!response.ok) {
    const data = await response.json().catch(() => null);
    if (response.status === 401) listeners.unauthorized.forEach((fn) => fn());
    throw new ApiError(response.status, data);
  }
  return response;
}

export async function getJson(path, options) {
  return (await request(path, options)).json();
}

/** Yield {id, event, data} for each SSE message of a streaming response body. */
export async function* sseMessages(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const message = parseBlock(block);
      if (message) yield message;
    }
  }
}

function parseBlock(block) {
  const message = { id: null, event: "message", data: "" };
  let seen = false;
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "data") { message.data += (seen ? "\n" : "") + value; seen = true; }
    else if (field === "id") message.id = value;
    else if (field === "event") message.event = value;
  }
  return seen ? message : null;
}

/** The time (ms since the epoch) a Redis stream entry id was written. */
export function entryTime(entryId) {
  return entryId ? Number(entryId.split("-")[0]) : null;
}

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "class") node.className = value;
    else if (name === "dataset") Object.assign(node.dataset, value);
    else if (name === "style") Object.assign(node.style, value); // CSSOM: allowed by the CSP
    else if (value !== null && value !== undefined) node.setAttribute(name, value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

export function ms(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "–";
  const value = seconds * 1000;
  return value >= 10000 ? `${(value / 1000).toFixed(1)} s` : `${Math.round(value)} ms`;
}

export function clock(epochSeconds) {
  return epochSeconds ? new Date(epochSeconds * 1000).toLocaleTimeString() : "–";
}
