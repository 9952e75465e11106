"""The status page: escaped when rendered, and live in a real browser (headless Chromium driven
by Playwright): the fleet's worker shows, and a running request's token count grows on the
page without a reload."""

from __future__ import annotations

import json
import os
import shutil
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from playwright.sync_api import Browser, Page, sync_playwright
from playwright.sync_api import Error as PlaywrightError

from mlx_redis_gateway.fleet_status import DeadLetter, FleetStatus, RunningRequest
from mlx_redis_gateway.status_page import render_fragment, render_page
from mlx_redis_protocol.activity import RequestActivity
from mlx_redis_protocol.catalogue import DefaultStreamStatus, ModelStatus, QueueStatus
from mlx_redis_protocol.catalogue import Fleet as Catalogue
from mlx_redis_protocol.heartbeat import Heartbeat, ServedModel
from tests.gateway.conftest import Fleet
from tests.support.gateway import GatewayFactory
from tests.support.processes import mlx_worker

# Where a browser is looked for: $CHROMIUM first, then the names apt and Homebrew install.
BROWSERS = (
    "chromium",
    "chromium-browser",
    "google-chrome",
    "/Applications/Chromium.app/Contents/MacOS/Chromium",
    "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome",
)
HOSTILE = '<script>alert("pwned")</script>'


def _queue(stream: str, **counts: Any) -> QueueStatus:
    fields: dict[str, Any] = dict(length=0, lag=0, pending=0, oldest_pending_seconds=None)
    fields.update(dead_letters=0, group=True)
    return QueueStatus(stream=stream, **{**fields, **counts})


def _hostile_status() -> FleetStatus:
    worker = "<b>w1</b>"
    beat = Heartbeat(
        worker_id=worker,
        pid=42,
        started_at=1_000.0,
        in_flight=1,
        default_model="tiny",
        models={"tiny": ServedModel(max_concurrency=8, free_slots=7, in_flight=1)},
        version='1.0"><img src=x onerror=alert(1)>',
    )
    model = ModelStatus(
        "tiny",
        (worker,),
        7,
        8,
        _queue("p:jobs:tiny", length=3, pending=1, lag=2, dead_letters=1),
        media=("image", "<video>"),  # a hostile heartbeat's kind would be dropped; escaped anyway
    )
    return FleetStatus(
        at=4_700.0,
        fleet=Catalogue(
            models=(model,),
            default=DefaultStreamStatus(_queue("p:jobs"), (worker,), {"tiny": 1}),
            heartbeats=(beat,),
        ),
        running=(RunningRequest(worker, RequestActivity("req-1", "tiny", 1, 17, 4_690.0)),),
        throughput=tuple((start, 0.0) for start in range(4_400, 4_700, 2)),
        bucket_seconds=2,
        dead_letters=(
            DeadLetter("p:jobs:tiny:dead", "4600000-0", 4_600.0, "req-0", "bad_job", HOSTILE, 3),
        ),
    )


def test_render_escapes_what_comes_from_redis() -> None:
    page = render_page(_hostile_status())
    assert HOSTILE not in page and "<b>w1</b>" not in page and "<img" not in page
    assert "&lt;script&gt;alert(&quot;pwned&quot;)&lt;/script&gt;" in page
    assert 'data-worker-id="&lt;b&gt;w1&lt;/b&gt;"' in page
    assert page.count("<script>") == 1  # the page's own refresh script, nothing else
    fragment = render_fragment(_hostile_status())
    assert fragment in page and "<script>" not in fragment
    assert 'data-request-id="req-1"' in fragment and 'data-tokens="17"' in fragment
    assert 'data-max="1"' in fragment  # all-zero throughput: an axis from 0 to 1
    assert '<span class="muted media">+ images, &lt;video&gt;s</span>' in page


def _browser_executable() -> str:
    for candidate in (os.environ.get("CHROMIUM"), *BROWSERS):
        found = candidate and shutil.which(candidate)
        if found:
            return found
    pytest.fail(
        "no Chromium for the status page's browser test: install it with "
        "`bash ops/install-test-deps.sh` (Debian/Ubuntu: apt-get install chromium) or point "
        "$CHROMIUM at a Chromium or Chrome executable"
    )


@pytest.fixture
def browser() -> Iterator[Browser]:
    """Headless Chromium from the system (Playwright's own browser download is never used)."""
    executable = _browser_executable()
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


class LongStream(threading.Thread):
    """A streamed chat completion long enough to watch; ``stop`` closes it (the gateway then
    aborts the job)."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
        self.request_id: str | None = None
        self.error: BaseException | None = None
        self.started_streaming = threading.Event()
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            stream = self.client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "count to a thousand"}],
                max_tokens=8000,  # the tiny model's greedy answer has no end of text this early
                temperature=0,
                stream=True,
            )
            with stream:
                self.request_id = stream.response.headers["x-request-id"]
                self.started_streaming.set()
                for _chunk in stream:
                    if self.stopping.is_set():
                        break
        except BaseException as exc:
            self.error = exc
        finally:
            self.started_streaming.set()

    def stop(self) -> None:
        self.stopping.set()
        self.join(30)


def _tokens(page: Page, selector: str) -> int:
    return int(page.get_attribute(f"{selector} .tokens", "data-tokens") or -1)


def test_status_page_is_live_in_a_browser(
    fleet: Fleet, gateways: GatewayFactory, browser: Browser, tmp_path: Path
) -> None:
    gateway = gateways.start()
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{gateway.url}/")
    worker_row = f'tr.worker[data-worker-id="{fleet.worker.worker_id}"]'
    page.wait_for_selector(worker_row, timeout=60_000)
    assert page.inner_text(f"{worker_row} .worker-id") == fleet.worker.worker_id
    assert page.get_attribute(f'{worker_row} .model[data-model="tiny"]', "data-max") == "8"
    # A reload would lose this: the updates below must come from the page's own script.
    page.evaluate("window.loadedOnce = true")

    job = LongStream(gateway.base_url)
    job.start()
    try:
        assert job.started_streaming.wait(30) and job.request_id, f"no stream: {job.error!r}"
        running = f'tr.running[data-request-id="{job.request_id}"]'
        page.wait_for_selector(running, timeout=60_000)
        first = _tokens(page, running)
        page.wait_for_function(
            "([row, seen]) => Number(document.querySelector(row + ' .tokens')?.dataset.tokens)"
            " > seen",
            arg=[running, first],
            timeout=60_000,
        )
        second = _tokens(page, running)
        assert second > first >= 0
        assert page.evaluate("window.loadedOnce") is True, "the page was reloaded"
        assert job.error is None and job.is_alive(), f"the job ended early: {job.error!r}"

        screenshot = tmp_path / "status-page.png"
        # Chromium renders on a CPU the suite shares with other test processes.
        page.screenshot(path=str(screenshot), full_page=True, timeout=120_000)
        print(f"status page screenshot: {screenshot}")
        data = screenshot.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 20_000

        with urllib.request.urlopen(f"{gateway.url}/status.json", timeout=5) as answer:
            status = json.load(answer)
        workers = {w["worker_id"]: w for w in status["workers"]}
        shown = page.eval_on_selector_all("tr.worker", "rows => rows.map(r => r.dataset.workerId)")
        assert sorted(shown) == sorted(workers) == [fleet.worker.worker_id]
        assert workers[fleet.worker.worker_id]["models"]["tiny"]["max_concurrency"] == 8
        assert "tiny" in {m["model"] for m in status["models"]}
        ours = [r for r in status["running"] if r["request_id"] == job.request_id]
        assert len(ours) == 1 and ours[0]["worker_id"] == fleet.worker.worker_id
        assert ours[0]["tokens"] >= second
    finally:
        job.stop()
    assert job.error is None, f"the stream failed: {job.error!r}"

    # A failed refresh marks the page stale and the next good one clears it.
    page.route("**/status/fragment", lambda route: route.abort())
    page.wait_for_selector('#status[data-stale="true"]', state="attached", timeout=60_000)
    page.unroute("**/status/fragment")
    page.wait_for_selector('#status[data-stale="false"]', state="attached", timeout=60_000)
    assert page.evaluate("window.loadedOnce") is True


def test_with_keys_a_browser_opens_the_page_with_an_operator_key_as_password(
    fleet: Fleet, gateways: GatewayFactory, browser: Browser, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    added = mlx_worker("api-key", "add", "ops", "--file", str(keys), "--operator")
    assert added.returncode == 0, added.stderr
    gateway = gateways.start("--api-keys", str(keys))

    # Without credentials: a 401 whose challenge makes a browser ask for them (a headless one
    # cannot ask, and fails the navigation instead).
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{gateway.url}/", timeout=5)
    assert refused.value.code == 401
    assert refused.value.headers["WWW-Authenticate"].startswith("Basic ")
    with pytest.raises(PlaywrightError, match="ERR_INVALID_AUTH_CREDENTIALS"):
        browser.new_page().goto(f"{gateway.url}/")

    context = browser.new_context(
        http_credentials={"username": "ops", "password": added.stdout.strip()}
    )
    page = context.new_page()
    answer = page.goto(f"{gateway.url}/")
    assert answer is not None and answer.status == 200
    page.wait_for_selector(f'tr.worker[data-worker-id="{fleet.worker.worker_id}"]')
    # The page's own refreshes carry the credentials too: a fresh fragment replaces the first.
    first = page.get_attribute(".fragment", "data-at")
    page.wait_for_function(
        "seen => document.querySelector('.fragment')?.dataset.at !== seen", arg=first
    )
    assert page.get_attribute("#status", "data-stale") == "false"
    context.close()
