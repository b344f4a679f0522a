"""The web console (server/edges/console.py) in a real browser: headless Chromium driven by Selenium against a real
broker with real queues, plus its JSON and its guards over plain HTTP.

Chromium and chromedriver come from the system's packages (.ci/run installs them); without them these tests
skip, unless MQKS_BROWSER_TESTS=1 (CI) makes that a failure. MQKS_CONSOLE_SCREENSHOTS=DIR saves the pages
as PNG files there (docs/console-*.png were made that way).
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import BrokerProcess, Wire
from helpers import free_port, unique

TOKEN = "console-s3cret-0123456789"
WAIT_SECONDS = 15.0
HOSTILE = "<img/src=x/onerror=window.pwned=1><script>window.pwned=2</script>"


def browser_or_skip() -> Any:
    """A headless Chromium under Selenium; skipped where the system has none (a failure in CI)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    if webdriver is None or chromium is None or driver_path is None:
        reason = "headless Chromium, chromedriver and selenium are needed (apt-get install chromium chromium-driver)"
        if os.environ.get("MQKS_BROWSER_TESTS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1280,860"):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(driver_path), options=options)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = browser_or_skip()
    yield driver
    driver.quit()


class Console:
    """A broker with its metrics port, and what a test asks of its console."""

    def __init__(self, make_broker: Callable[..., BrokerProcess], *flags: str) -> None:
        self.http_port = free_port()
        self.broker = make_broker("--metrics-port", str(self.http_port), *flags)
        self.url = f"http://127.0.0.1:{self.http_port}"

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
        return self.request("GET", path, headers=headers)

    def request(self, method: str, path: str, data: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers or {})
        opener = urllib.request.build_opener(NoRedirect)
        try:
            with opener.open(request, timeout=10) as answer:
                status, body, got = answer.status, answer.read(), dict(answer.headers)
        except urllib.error.HTTPError as e:
            status, body, got = e.code, e.read(), dict(e.headers)
        is_json = got.get("Content-Type", "").startswith("application/json")
        return status, json.loads(body) if is_json else body.decode(), got

    def wire(self) -> Wire:
        return self.broker.wire()


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any) -> None:
        return None  # a test reads the 303 itself


def text_of(browser: Any, selector: str) -> str:
    from selenium.webdriver.common.by import By

    found = browser.find_elements(By.CSS_SELECTOR, selector)
    return found[0].text if found else ""


def wait_text(browser: Any, selector: str, predicate: Callable[[str], bool], what: str) -> str:
    """Poll the page (bounded) until the element's text satisfies `predicate`; its text."""
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    seen: list[str] = []

    def check(driver: Any) -> str | bool:
        try:
            text = text_of(driver, selector)
        except StaleElementReferenceException:  # redrawn between finding and reading: look again
            return False
        seen.append(text)
        return text if predicate(text) else False

    try:
        return WebDriverWait(browser, WAIT_SECONDS, poll_frequency=0.1).until(check)
    except TimeoutException:
        raise AssertionError(f"{what}: {selector} showed {seen[-1:]!r}") from None


def screenshot(browser: Any, name: str) -> None:
    folder = os.environ.get("MQKS_CONSOLE_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(Path(folder) / f"console-{name}.png"))


def test_the_overview_renders_and_its_figures_follow_publishes(make_broker, browser) -> None:
    console = Console(make_broker)
    browser.get(console.url + "/")
    wait_text(browser, "#tile-published .value", lambda text: text == "0", "the overview before any publish")
    wire = console.wire()
    queue, event = unique("q"), unique("e")
    wire.send(b"c1 consume --confirm " + queue.encode() + b" " + event.encode() + b" --manual-ack")
    wire.expect(b"c1 ok ")
    wire.send(*(b"m%d publish %b data" % (n, event.encode()) for n in range(25)))
    wait_text(browser, "#tile-published .value", lambda text: text == "25", "the published count after 25")
    wait_text(browser, "#tile-unacked .value", lambda text: text == "25", "the unacked count")
    assert text_of(browser, "#tile-connections .value") != ""
    assert text_of(browser, "#workers").splitlines()[1].split()[:2] == ["0", "0\u201316383"]  # one worker: every slot
    assert "in memory only" in text_of(browser, "#log")
    screenshot(browser, "overview")


def test_the_queues_table_sorts_filters_and_links_to_each_queue(make_broker, browser) -> None:
    from selenium.webdriver.common.by import By

    console = Console(make_broker)
    wire = console.wire()
    prefix = unique("orders")
    depths = {f"{prefix}-a": 3, f"{prefix}-b": 7, f"{prefix}-c": 1, unique("other"): 2}
    for n, (queue, depth) in enumerate(depths.items()):
        wire.send(b"r%d rebind --confirm %b ev-%d" % (n, queue.encode(), n))
        wire.expect(b"r%d ok " % n)
        wire.send(*(b"m%d-%d publish ev-%d x" % (n, i, n) for i in range(depth)))
    wire.barrier()
    browser.get(console.url + "/#/queues")
    wait_text(browser, "#queues tbody", lambda text: all(name in text for name in depths), "every queue listed")
    filter_box = browser.find_element(By.ID, "filter")
    filter_box.send_keys(prefix)
    shown = wait_text(browser, "#queues tbody", lambda text: "other" not in text and prefix in text, "the filter")
    assert [line.split()[0] for line in shown.splitlines()] == [f"{prefix}-a", f"{prefix}-b", f"{prefix}-c"]
    browser.find_element(By.CSS_SELECTOR, "#queues th[data-key=depth]").click()  # ascending by ready messages
    by_depth = wait_text(browser, "#queues tbody", lambda text: text.splitlines()[0].startswith(f"{prefix}-c"),
                         "sorted by depth")
    assert [line.split()[:2] for line in by_depth.splitlines()] == [[f"{prefix}-c", "1"], [f"{prefix}-a", "3"],
                                                                    [f"{prefix}-b", "7"]]
    screenshot(browser, "queues")
    browser.find_element(By.LINK_TEXT, f"{prefix}-b").click()
    wait_text(browser, "#queue-name", lambda text: text == f"{prefix}-b", "the queue page")


def test_a_queue_page_shows_bindings_consumers_and_dead_letters(make_broker, browser) -> None:
    console = Console(make_broker)
    wire = console.wire()
    queue = unique("jobs")
    wire.send(b"c1 consume --confirm " + queue.encode() + b" job.* audit --manual-ack --prefetch=5 --max-retries=0")
    wire.expect(b"c1 ok ")
    wire.send(b"j1 publish job.resize one", b"j2 publish job.crop two")
    first = wire.recv_line()
    msg_id = first.split(b" ")[2]
    wire.send(b"r1 reject --confirm c1 " + msg_id)  # past --max-retries=0: to {queue}.dead
    wire.barrier()
    browser.get(console.url + "/#/queue/" + queue)
    wait_text(browser, "#queue-name", lambda text: text == queue, "the queue page")
    assert text_of(browser, "#bindings tbody").splitlines() == ["audit", "job.*"]
    consumer = wait_text(browser, "#consumers tbody", lambda text: text.startswith("c1"), "the consumer row")
    assert consumer.split() == ["c1", "yes", "5", "1"]  # no ack timeout: an empty cell
    dead = wait_text(browser, "#dead-letters tbody", lambda text: msg_id.decode() in text, "the dead letter")
    _, _, _, header, data = first.decode().split(" ", 4)
    assert dead.split() == [msg_id.decode(), header[len("event="):], "1", data]  # a peek: its event and data too
    assert text_of(browser, "#tile-dead .value") == "1"
    screenshot(browser, "queue")


def test_a_hostile_queue_name_shows_as_text_and_runs_nothing(make_broker, browser) -> None:
    from selenium.common.exceptions import NoAlertPresentException

    console = Console(make_broker)
    wire = console.wire()
    wire.send(b"c1 consume --confirm " + HOSTILE.encode() + b" " + HOSTILE.encode())
    wire.expect(b"c1 ok ")
    for path in ("/#/queues", "/#/queue/" + urllib.request.quote(HOSTILE, safe="")):
        browser.get(console.url + path)
        shown = wait_text(browser, "#view", lambda text: HOSTILE in text, f"the name as text on {path}")
        assert HOSTILE in shown
        assert browser.execute_script("return window.pwned") is None
        with pytest.raises(NoAlertPresentException):
            browser.switch_to.alert.text  # noqa: B018 - reading it is the check
    assert browser.execute_script("return document.querySelectorAll('#view img, #view script').length") == 0


def test_the_schedules_page_lists_each_schedule(make_broker, browser) -> None:
    console = Console(make_broker)
    wire = console.wire()
    name = unique("nightly")
    wire.send(b"s1 schedule --confirm " + name.encode() + b" --cron 0 3 * * * cleanup now")
    wire.expect(b"s1 ok ")
    browser.get(console.url + "/#/schedules")
    row = wait_text(browser, "#schedules tbody", lambda text: name in text, "the schedule row")
    assert row.split()[:8] == [name, "cron", "0", "3", "*", "*", "*", "cleanup"]
    assert row.rstrip().endswith(" 03:00:00 UTC"), row  # the rule's time zone, not the browser's


def test_a_token_is_asked_for_by_the_pages_and_the_json(make_broker, browser, tmp_path) -> None:
    from selenium.webdriver.common.by import By

    (tmp_path / "tokens").write_text(TOKEN + "\n")
    console = Console(make_broker, "--auth-token-file", str(tmp_path / "tokens"))
    status, body, _ = console.get("/api/stats")
    assert status == 401 and "token" in body["error"]
    status, _, headers = console.get("/")
    assert status == 303 and headers["Location"] == "/login"
    status, body, _ = console.get("/api/stats", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and body["version"]
    status, _, _ = console.get("/api/stats", headers={"Authorization": "Bearer wrong"})
    assert status == 401
    status, _, headers = console.request("POST", "/login", f"token={TOKEN}".encode(),
                                         {"Content-Type": "application/x-www-form-urlencoded"})
    cookie = headers["Set-Cookie"]
    assert status == 303 and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    browser.delete_all_cookies()
    browser.get(console.url + "/")
    assert browser.current_url.endswith("/login")
    browser.find_element(By.NAME, "token").send_keys("wrong-token")
    browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    # the click submits a form: the answer is a new page, which loads after click() returns
    wait_text(browser, "body", lambda text: "not one of this broker's" in text, "the wrong token refused")
    browser.find_element(By.NAME, "token").send_keys(TOKEN)
    browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait_text(browser, "#tile-version .value", lambda text: text != "", "the console after signing in")
    assert browser.execute_script("return document.cookie") == ""  # HttpOnly: no script reads the token
    browser.delete_all_cookies()


def test_changes_are_off_unless_enabled_and_then_need_the_csrf_token(make_broker) -> None:
    read_only = Console(make_broker)
    status, body, _ = read_only.request("POST", "/api/queue/delete?name=anything")
    assert status == 403 and "read-only" in body["error"]
    console = Console(make_broker, "--console-actions")
    wire = console.wire()
    queue = unique("doomed")
    wire.send(b"r1 rebind --confirm " + queue.encode() + b" e1")
    wire.expect(b"r1 ok ")
    status, body, _ = console.request("POST", "/api/queue/delete?name=" + queue)
    assert status == 403 and "CSRF" in body["error"]
    _, session, _ = console.get("/api/session")
    status, body, _ = console.request("POST", "/api/queue/delete?name=" + queue,
                                      headers={"X-CSRF-Token": session["csrf"], "Origin": "http://evil.example"})
    assert status == 403  # the right token from another site's page: refused
    status, body, _ = console.request("POST", "/api/queue/delete?name=" + queue,
                                      headers={"X-CSRF-Token": session["csrf"]})
    assert (status, body) == (200, {"deleted": queue})
    _, rows, _ = console.get("/api/queues")
    assert queue not in [row["queue"] for row in rows]


def test_purge_and_moving_dead_letters_back_from_the_queue_page(make_broker, browser) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    console = Console(make_broker, "--console-actions")
    wire = console.wire()
    queue = unique("orders")
    wire.send(b"c1 consume --confirm " + queue.encode() + b" order.* --manual-ack --max-retries=0")
    wire.expect(b"c1 ok ")
    for i in range(3):  # three dead letters
        wire.send(b"m%d publish order.paid poison-%d" % (i, i))
        wire.expect(b"c1 ok m%d event=order.paid poison-%d" % (i, i))
        wire.send(b"r%d reject --confirm c1 m%d" % (i, i))
        wire.expect(b"r%d ok " % i)
    wire.send(b"d1 delete_consumer --confirm c1")
    wire.expect(b"d1 ok ")
    browser.get(console.url + "/#/queue/" + queue)
    wait_text(browser, "#tile-dead .value", lambda text: text == "3", "three dead letters")
    browser.execute_script("window.scrollTo(0, document.body.scrollHeight)")  # the screenshot shows the buttons
    screenshot(browser, "queue-actions")
    # one dead letter moved back by its row's button: the newest first in the table, m2
    browser.find_element(By.CSS_SELECTOR, "#dead-letters tbody tr:first-child button.requeue-one").click()
    wait_text(browser, "#action-result", lambda text: text == "moved 1 dead letters back", "the one moved back")
    wait_text(browser, "#tile-depth .value", lambda text: text == "1", "the dead letter back in the queue")
    assert "m2" not in text_of(browser, "#dead-letters tbody")
    browser.find_element(By.ID, "requeue-dead").click()
    wait_text(browser, "#action-result", lambda text: text == "moved 2 dead letters back", "the rest moved back")
    wait_text(browser, "#tile-depth .value", lambda text: text == "3", "all three in the queue")
    assert text_of(browser, "#tile-dead .value") == "0"
    browser.find_element(By.ID, "purge-queue").click()
    WebDriverWait(browser, WAIT_SECONDS).until(expected_conditions.alert_is_present()).accept()  # "Drop the 3 ...?"
    wait_text(browser, "#action-result", lambda text: text == "purged 3 messages", "the purge")
    wait_text(browser, "#tile-depth .value", lambda text: text == "0", "an empty queue")
    wire.send(b"c2 consume " + queue.encode())
    assert wire.barrier() == []  # nothing came back: the purge dropped them in the broker, not on the page


def test_purge_and_requeue_dead_over_http_need_the_flag_the_token_and_good_names(make_broker) -> None:
    read_only = Console(make_broker)
    for action in ("purge", "requeue-dead"):
        status, body, _ = read_only.request("POST", f"/api/queue/{action}?name=anything")
        assert status == 403 and "read-only" in body["error"]
    console = Console(make_broker, "--console-actions")
    wire = console.wire()
    queue = unique("q")
    wire.send(b"r1 rebind --confirm " + queue.encode() + b" e1")
    wire.expect(b"r1 ok ")
    wire.send(b"m1 publish --confirm e1 x", b"m2 publish --confirm e1 y")
    wire.expect(b"m1 ok ")
    wire.expect(b"m2 ok ")
    _, session, _ = console.get("/api/session")
    csrf = {"X-CSRF-Token": session["csrf"]}
    assert console.request("POST", f"/api/queue/purge?name={queue}")[0] == 403  # no CSRF token
    for bad in ("/api/queue/purge?name=--all", "/api/queue/requeue-dead?name=q&msg_id=a%20b", "/api/queue/purge"):
        status, body, _ = console.request("POST", bad, headers=csrf)
        assert status == 400, (bad, body)
    assert console.request("POST", "/api/queue/rename?name=q", headers=csrf)[0] == 404
    assert console.request("POST", f"/api/queue/purge?name={queue}", headers=csrf)[:2] == (200, {"purged": 2})
    assert console.request("POST", f"/api/queue/requeue-dead?name={queue}&msg_id=m1",
                           headers=csrf)[:2] == (200, {"requeued": 0})
    _, rows, _ = console.get("/api/queues")
    assert [row["depth"] for row in rows if row["queue"] == queue] == [0]


def test_the_json_is_the_figures_of_stats_and_queues(make_broker) -> None:
    console = Console(make_broker, "--workers", "2")
    wire = console.wire()
    for n in range(6):
        wire.send(b"r%d rebind --confirm %b e" % (n, unique(f"q{n}").encode()))
        wire.expect(b"r%d ok " % n)
    wire.send(b"m1 publish e x")
    wire.send(b"s stats", b"q queues")
    stats = json.loads(wire.recv_line().partition(b" ok ")[2])
    rows = []
    while (line := wire.recv_line()) != b"q ok --end":
        rows.append(json.loads(line.partition(b" ok ")[2]))
    _, api_stats, _ = console.get("/api/stats")
    _, api_rows, _ = console.get("/api/queues")
    assert api_rows == rows  # every worker's queues, merged by the relay as for `queues`
    for key in ("published", "queued", "queues", "messages_waiting", "workers"):
        assert api_stats[key] == stats[key], key
    _, topology, _ = console.get("/api/topology")
    assert topology["workers"] == 2 and len(topology["slot_map"]) == 2
