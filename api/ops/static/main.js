// The console's shell: views by URL hash, the API key dialog, and polling of the shown view
// (one request chain at a time, paused while the tab is hidden).

import { auth } from "/console/api.js";
import { FLEET_POLL_MS, refreshFleet } from "/console/fleet.js";
import { initJobs, refreshJobs } from "/console/jobs.js";
import { initPlayground, loadModels } from "/console/playground.js";

const $ = (id) => document.getElementById(id);
const VIEWS = {
  playground: { refresh: loadModels, everyMs: 10000 },
  fleet: { refresh: refreshFleet, everyMs: FLEET_POLL_MS },
  jobs: { refresh: refreshJobs, everyMs: 2000 },
};
let timer = null;

function currentView() {
  const name = location.hash.slice(1);
  return name in VIEWS ? name : "playground";
}

function show() {
  const name = currentView();
  for (const view of Object.keys(VIEWS)) $(`view-${view}`).hidden = view !== name;
  for (const link of document.querySelectorAll("nav a")) {
    link.classList.toggle("active", link.dataset.view === name);
  }
  poll();
}

async function poll() {
  clearTimeout(timer);
  const name = currentView();
  if (document.visibilityState === "visible" && auth.ready) {
    try {
      await VIEWS[name].refresh();
      status("");
    } catch (error) {
      status(error.status === 401 ? "" : `${error.message}`);
    }
  }
  if (name === currentView()) timer = setTimeout(poll, VIEWS[name].everyMs);
}

function status(text) {
  $("status-line").textContent = text;
}

function askForKey() {
  const dialog = $("key-dialog");
  if (!dialog.open) dialog.showModal();
  $("key-input").focus();
}

function initKeyDialog() {
  $("key-button").addEventListener("click", askForKey);
  $("key-form").addEventListener("submit", () => {
    auth.key = $("key-input").value.trim();
    $("key-input").value = "";
    loadModels().catch(() => {});
    poll();
  });
  $("key-forget").addEventListener("click", () => { auth.key = ""; $("key-dialog").close(); });
  auth.onUnauthorized(askForKey);
  $("key-button").hidden = !auth.required;
}

initKeyDialog();
initPlayground();
initJobs();
window.addEventListener("hashchange", show);
document.addEventListener("visibilitychange", () => document.visibilityState === "visible" && poll());
if (!auth.ready) askForKey();
if (currentView() !== "playground") loadModels().catch(() => {});
show();
