"""The live page (``/ui/``) in a real browser: headless Chromium against a real server under load.

Chromium and its driver are the distribution's packages (``make setup`` installs them where it can);
Selenium drives them. Where they are missing the tests skip with the reason, except in CI, where a
missing browser fails: the page must be tested there.

Each test starts a chapter's server at its defaults, opens the page, puts it under load from a few
client threads (loopback, bounded in time), and asserts from the DOM what a learner should see:
batches leaving (chapter 3), sequences joining and leaving and the KV grid changing (chapter 8), a
burst button answered by the server, and, once the load has stopped, counters equal to ``/stats``.
Each takes a screenshot under load: into the test's temporary folder, or with
``LIVE_PAGE_SCREENSHOTS=benchmarks/reference/cpu`` as ``<that>/<chapter>/live-page.png`` (the
committed pictures the READMEs show).
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from tests.conftest import serve

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
LOAD_LIMIT_S = 90  # no load thread outlives this, whatever happens to the test


def browser_or_skip():
    """A headless Chromium driven by Selenium; skip (fail in CI) with the reason when it cannot start."""
    missing = [name for name, path in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER)) if path is None]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("the selenium package")
    if missing:
        reason = f"{' and '.join(missing)} not installed (make setup installs them with apt-get where it can)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test: {reason}")
        pytest.skip(reason)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1500,1100",
                 "--disable-extensions", "--no-first-run", "--disable-background-networking"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


@pytest.fixture
def browser():
    driver = browser_or_skip()
    try:
        yield driver
    finally:
        driver.quit()


@contextmanager
def load(url: str, users: int, body: Callable[[random.Random], dict]) -> Iterator[list[int]]:
    """``users`` threads sending requests one after another until the block ends (or ``LOAD_LIMIT_S``).

    Yields the list of statuses so far; every thread is joined before the block returns.
    """
    stop = threading.Event()
    statuses: list[int] = []
    deadline = time.monotonic() + LOAD_LIMIT_S

    def user(seed: int) -> None:
        rng = random.Random(seed)
        with requests.Session() as session:
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    statuses.append(session.post(f"{url}/v1/inference", json=body(rng), timeout=60).status_code)
                except requests.RequestException:
                    statuses.append(-1)

    threads = [threading.Thread(target=user, args=(seed,), daemon=True) for seed in range(users)]
    for thread in threads:
        thread.start()
    try:
        yield statuses
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=70)


def mixed_body(rng: random.Random) -> dict:
    return {"input_ids": [rng.randrange(1, 250) for _ in range(rng.choice((8, 24, 48)))], "max_new_tokens": rng.choice((8, 16, 48, 96))}


def wait_for(condition: Callable[[], object], timeout_s: float, what: str) -> object:
    """Poll the page (a browser in another process: there is no event to await from here)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} did not happen within {timeout_s} s")


def text(driver, element_id: str) -> str:
    # Read in one script: the page replaces elements between two WebDriver calls.
    return driver.execute_script("const e = document.getElementById(arguments[0]); return e ? e.textContent : null;", element_id)


def count(driver, selector: str) -> int:
    return driver.execute_script("return document.querySelectorAll(arguments[0]).length;", selector)


def screenshot(driver, chapter: str, tmp_path: Path, name: str = "live-page.png") -> Path:
    folder = os.environ.get("LIVE_PAGE_SCREENSHOTS")
    path = Path(folder) / chapter / name if folder else tmp_path / f"{chapter}-{name}"
    path.parent.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(path)), "the browser took no screenshot"
    return path


def open_page(driver, url: str) -> None:
    driver.get(f"{url}/ui/")
    wait_for(lambda: text(driver, "status") == "live", 20, "the page's event stream connecting")


def page_agrees_with_stats(driver, url: str, read: Callable[[dict], dict], idle: Callable[[dict], bool], keys: tuple[str, ...]) -> dict:
    """Wait until the server is idle (the load has stopped) and the page shows ``/stats``' figures for
    ``keys``; both read afresh each time (a readiness probe may compute a request meanwhile). Returns the stats."""
    agreed: dict = {}

    def agree() -> bool:
        stats = read(requests.get(f"{url}/stats", timeout=5).json())
        agreed.update(stats)
        return idle(stats) and all(text(driver, f"stat-{key}") == str(stats[key]) for key in keys)

    try:
        wait_for(agree, 60, "the page's counters equal to /stats")
    except AssertionError:
        shown = {key: text(driver, f"stat-{key}") for key in keys}
        raise AssertionError(f"the page shows {shown}, /stats says {({key: agreed.get(key) for key in keys})}") from None
    return agreed


def test_chapter_8_page_shows_sequences_join_and_leave_and_the_block_grid_change_and_counts_equal_stats(browser, tmp_path) -> None:
    with serve("ch08") as server:
        wait_for(lambda: requests.get(f"{server.url}/readyz", timeout=5).status_code == 200, 60, "readiness")
        open_page(browser, server.url)
        with load(server.url, 12, mixed_body) as statuses:
            seen_rows: set[str] = set()
            signatures: set[str] = set()

            def rows_and_grid() -> bool:
                rows = set(browser.execute_script("return [...document.querySelectorAll('#running .row')].map((r) => r.dataset.seq);"))
                signatures.add(browser.execute_script("return document.getElementById('blocks').dataset.signature || '';"))
                left = seen_rows - rows  # once on the page, now gone: a sequence left
                seen_rows.update(rows)
                return bool(left) and len(rows) >= 2 and len(signatures - {""}) >= 3

            wait_for(rows_and_grid, 60, "sequences joining and leaving and the KV grid changing")
            wait_for(lambda: count(browser, "#running .row") >= 6 and int(text(browser, "stat-finished")) >= 30, 60,
                     "a crowd of running sequences, and answers enough for the lines")
            picture = screenshot(browser, "ch08", tmp_path)
        assert statuses and set(statuses) == {200}, f"the load got {sorted(set(statuses))}"
        assert picture.stat().st_size > 10_000

        stats = page_agrees_with_stats(browser, server.url, lambda s: s["scheduler"], lambda s: s["running"] == s["waiting"] == 0,
                                       ("steps", "finished", "tokens_generated", "preemptions", "running", "blocks_used", "blocks_total"))

        # The burst button goes through the public API like any client; the shared prefix is found cached.
        hits_before = stats["prefix_cache"]["hits_tokens"]
        browser.find_element("css selector", "button[data-burst=shared]").click()
        wait_for(lambda: text(browser, "burst-result") == "shared: 12 × 200", 60, "the shared-prefix burst answered")
        after = requests.get(f"{server.url}/stats", timeout=5).json()["scheduler"]
        assert after["prefix_cache"]["hits_tokens"] > hits_before, "the burst's shared prefix was never found in the cache"

        # The embedded GPT has no chat template: the chat box shows the server's refusal, not a silent nothing.
        chat(browser, "hello?")
        wait_for(lambda: "no chat template" in (text(browser, "chat-log") or ""), 30, "the chat box showing the 400's reason")


def chat(driver, message: str) -> None:
    field = driver.find_element("id", "chat-input")
    field.send_keys(message)
    driver.find_element("css selector", "#chat-form button").click()


def chat_dataset(driver) -> dict:
    return driver.execute_script("return {...document.getElementById('chat').dataset};")


def test_chapter_8_chat_box_streams_a_real_models_turn_while_the_step_view_shows_its_sequence_join_and_leave(browser, tmp_path) -> None:
    """The chat box with SmolLM2, among other clients' requests: the answer streams in, and the step view
    outlines the turn's sequence (its ``X-Sequence-Id``), which joins, decodes and leaves at its end of turn."""
    with serve("ch08", "--weights", "smollm2", "--precision", "fp32", "--attention", "gather", "--probe-interval-s", "3600") as server:
        wait_for(lambda: requests.get(f"{server.url}/readyz", timeout=5).status_code == 200, 120, "readiness")
        open_page(browser, server.url)
        short = lambda rng: {"input_ids": [rng.randrange(1000, 40000) for _ in range(rng.choice((8, 24)))], "max_new_tokens": 24}  # noqa: E731
        with load(server.url, 3, short) as statuses:
            chat(browser, "What is the capital of France?")
            wait_for(lambda: chat_dataset(browser).get("joined") and count(browser, "#running .row.yours") == 1
                     and count(browser, "#running .row") >= 2, 60, "the turn's row outlined among the running sequences")
            picture = screenshot(browser, "ch08", tmp_path, "chat-box.png")
            wait_for(lambda: chat_dataset(browser).get("finish"), 120, "the turn's end")
        assert statuses and set(statuses) == {200}, f"the load got {sorted(set(statuses))}"
        assert "model: The capital of France is Paris." in text(browser, "chat-log")
        seen = chat_dataset(browser)
        assert (seen.get("decoded"), seen.get("finish")) == ("yes", "stop")
        wait_for(lambda: chat_dataset(browser).get("left") == "stop", 10, "the step view showing the turn leave at its end of turn")
        assert picture.stat().st_size > 10_000


def test_chapter_3_page_shows_batches_leave_and_why_and_counts_equal_stats(browser, tmp_path) -> None:
    with serve("ch03") as server:
        open_page(browser, server.url)
        with load(server.url, 12, mixed_body) as statuses:
            wait_for(lambda: count(browser, "#batch-rows .row") >= 2, 60, "a batch of several rows drawn")
            wait_for(lambda: "left because" in text(browser, "batch-why"), 10, "the reason a batch left")
            wait_for(lambda: int(text(browser, "stat-batches")) >= 12, 60, "batches enough for the history and the lines")
            picture = screenshot(browser, "ch03", tmp_path)
        assert statuses and set(statuses) == {200}, f"the load got {sorted(set(statuses))}"
        assert picture.stat().st_size > 10_000

        stats = page_agrees_with_stats(browser, server.url, lambda s: s["batcher"], lambda s: s["queued"] == 0,
                                       ("requests", "batches", "largest_batch", "failed_batches"))
        assert stats["requests"] == len(statuses)
