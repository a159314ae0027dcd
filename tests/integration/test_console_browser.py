"""The web console in a real headless Chromium (Debian's `chromium`, driven by Playwright):
chat with streamed text, the worker card's KV bar moving while the answer runs, the jobs
view with a job's phases and events, no console errors. Screenshots of the three views go
to $LADLE_SCREENSHOT_DIR (`docs/` refreshes the README's) or the test's temporary folder.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.model_files import DEFAULT_MODEL_NAME
from tests.support.harness import Service, start_service

CHROMIUM = os.environ.get("LADLE_CHROMIUM") or shutil.which("chromium")
KEY = "console-test-key"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no Chromium: install Debian's `chromium` (apt-get install -y chromium; .ci/run "
        "does) or point LADLE_CHROMIUM at one",
    ),
]
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
WAIT_MS = 120_000


@pytest.fixture(scope="module")
def console_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = start_service(
        Path(DEFAULT_MODEL_NAME),
        tmp_path_factory.mktemp("console-logs"),
        api_keys=KEY,
        kv_cache_size_mb=64,  # ~90 blocks: one long answer moves the bar visibly
        heartbeat_interval_s=0.2,
    )
    yield svc
    svc.stop()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("LADLE_SCREENSHOT_DIR") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def open_console(context: object, url: str, errors: list[str]) -> object:
    """A tab on the console, its errors collected, the API key entered in its dialog."""
    page = context.new_page()  # type: ignore[attr-defined]
    page.set_default_timeout(WAIT_MS)
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url)
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", KEY)
    page.click("#key-form button[type=submit]")
    return page


def test_console_chat_fleet_and_jobs(console_service: Service, shots: Path) -> None:
    errors: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        chat = open_console(context, console_service.base_url + "/", errors)
        fleet = open_console(context, console_service.base_url + "/console#fleet", errors)
        fleet.wait_for_selector(".card[data-kv-used='0']")

        chat.wait_for_selector("#pg-model option[value='SmolLM2-135M-Instruct']", state="attached")
        chat.fill("#pg-system", "You are a storyteller who writes long stories.")
        chat.fill("#pg-temperature", "0")
        chat.fill("#pg-max-tokens", "200")
        chat.fill("#pg-input", "Tell me a long story about a dragon who learns to cook.")
        chat.press("#pg-input", "Enter")

        # Streamed: text in the page before the answer's closing line is.
        chat.wait_for_function(
            "() => { const m = document.querySelector('.msg.assistant');"
            " return m && m.querySelector('.text').textContent.length > 0"
            " && !m.querySelector('.stats'); }"
        )
        first_text = chat.text_content(".msg.assistant .text") or ""
        # The worker card's KV bar moves while the answer runs, and empties after it.
        fleet.wait_for_selector(".card:not([data-kv-used='0'])")
        width = fleet.eval_on_selector(".card .bar-fill", "e => parseFloat(e.style.width)")
        assert width > 0
        fleet.wait_for_selector("[data-field='tokens_per_s']:not(:text-is('0.0'))")
        fleet.screenshot(path=str(shots / "console-fleet.png"))
        chat.wait_for_selector(".msg.assistant .stats[data-finish]")
        final_text = chat.text_content(".msg.assistant .text") or ""
        assert len(final_text) > len(first_text) > 0 and final_text.startswith(first_text)
        stats = chat.text_content(".msg.assistant .stats") or ""
        assert "TTFT" in stats and "tok/s" in stats and "finish: " in stats
        fleet.wait_for_selector(".card[data-kv-used='0']")

        # The same chat sent as a job: its events are listed under the answer.
        chat.check("#pg-as-job")
        chat.fill("#pg-max-tokens", "16")
        chat.fill("#pg-input", "Give the dragon a name.")
        chat.press("#pg-input", "Enter")
        job_answer = ".msg.assistant >> nth=1"
        chat.wait_for_selector(f"{job_answer} >> .stats[data-finish]")
        kinds = chat.eval_on_selector_all(
            ".msg.assistant:nth-of-type(4) .events li", "items => items.map(i => i.dataset.kind)"
        )
        assert kinds[:2] == ["submitted", "started"] and kinds[-1] == "done", kinds
        assert "delta" in kinds
        chat.screenshot(path=str(shots / "console-playground.png"))

        chat.goto(console_service.base_url + "/console#jobs")
        chat.wait_for_selector("#jobs-rows tr[data-job-id] >> nth=1")
        assert chat.locator("#jobs-rows tr[data-job-id]").count() == 2
        chat.click("#jobs-rows tr[data-job-id] >> nth=1")  # the streamed chat, older
        chat.wait_for_selector("#job-timeline li[data-kind='done']")
        chat.wait_for_selector(".phase-bar .phase")
        chat.screenshot(path=str(shots / "console-jobs.png"))
        browser.close()
    assert errors == []
