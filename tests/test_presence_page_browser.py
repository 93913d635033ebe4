"""The operator's page in a real browser: Debian's Chromium, headless, driven by Selenium
through Debian's chromedriver (``.ci/run`` installs both; elsewhere these tests skip,
with the reason, where they are missing).

Against a real heartbeat server of two workers with raw-socket devices: the page loads,
its counts match the registry and the workers' own ``/metrics``, a device that goes
silent is listed with its reason within 2 s of its offline event, the search finds it,
and behind a reverse proxy that serves the page under a path prefix and cuts its stream
the page still works, by polling; and with the supervisor (the registry's keeper)
stopped by SIGSTOP, the page keeps its last answer, says so, and recovers.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest.browser import chromium_missing, open_chromium

from .test_heartbeat_clients import Server, raw_connect
from .test_heartbeat_clients import start_server as start_server  # the fixture, used by name
from .test_presence_page import fetch

IN_CI = os.environ.get("CI") == "true"
MISSING = chromium_missing()
pytestmark = pytest.mark.skipif(MISSING is not None and not IN_CI, reason=MISSING or "")

if MISSING is None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver


def online_in_metrics(server: Server, workers: int) -> int:
    """Devices online by the workers' own Prometheus figures."""
    assert server.status_port is not None
    total = 0
    for i in range(workers):
        with urllib.request.urlopen(f"http://127.0.0.1:{server.status_port + i}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        total += sum(int(float(v)) for v in re.findall(r"^heartbeat_devices_online\{[^}]*\} (\S+)$", text, re.M))
    return total


def wait(check: Callable[[], Any], timeout: float = 10.0, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = check()
        except Exception:  # an element mid-update (a stale reference): look again
            found = None
        if found or time.monotonic() > deadline:
            return found
        time.sleep(every)


def text_of(chrome: WebDriver, element_id: str) -> str:
    return str(chrome.find_element(By.ID, element_id).text)


def listed(chrome: WebDriver, client_id: str) -> Any:
    rows = chrome.find_elements(By.CSS_SELECTOR, f'#recent-body tr[data-client-id="{client_id}"]')
    return rows[0] if rows else None


@pytest.fixture
def chrome() -> Iterator[WebDriver]:
    with open_chromium() as browser:
        yield browser


def the_silent_device_is_listed_in_time(chrome: WebDriver, server: Server, client_id: str) -> Any:
    """Connect a device that then goes silent; return its row once listed, having checked
    it appeared within 2 s of its offline event."""
    silent = raw_connect(server.port, client_id, keep_alive=1)
    (gone,) = server.wait_for(lambda e: e.get("client_id") == client_id and e["status"] == "offline", timeout=5)
    row = wait(lambda: listed(chrome, client_id), timeout=5, every=0.02)
    shown_at = time.time()
    assert row is not None, chrome.find_element(By.ID, "recent-body").text
    late = shown_at - float(gone["time"])  # type: ignore[arg-type]
    assert late <= 2.0, f"listed {late:.2f} s after its offline event"
    silent.close()
    return row


def test_the_live_page_counts_the_registry_and_lists_a_silent_device_within_two_seconds(
    start_server: Any, chrome: WebDriver, tmp_path: Path
) -> None:
    server: Server = start_server(workers=2, status=True)
    assert server.status_port is not None
    devices = [raw_connect(server.port, f"sensor-{i:02d}", keep_alive=60) for i in range(20)]
    chrome.get(f"http://127.0.0.1:{server.status_port}/")
    assert wait(lambda: text_of(chrome, "online-count") == "20" and text_of(chrome, "mode") == "live")
    registry = fetch(server.status_port, "/presence.json")["registry"]
    assert registry["online"] == 20 == online_in_metrics(server, 2)
    rows = chrome.find_elements(By.CSS_SELECTOR, "#workers-body tr[data-worker]")
    assert sorted(str(r.get_attribute("data-worker")) for r in rows) == ["0", "1"]
    # The listener's devices, summed over the box's workers.
    name = f"mqtt://127.0.0.1:{server.port}"
    listener_cells = f'#listeners-body tr[data-listener="{name}"] td'
    assert wait(lambda: [c.text for c in chrome.find_elements(By.CSS_SELECTOR, listener_cells)][:2] == [name, "20"])

    row = the_silent_device_is_listed_in_time(chrome, server, "silent-dev")
    cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
    assert cells[1] == "keepalive-timeout" and cells[2] == "server"
    assert wait(lambda: text_of(chrome, "online-count") == "20")
    assert wait(lambda: "1 keep-alive timeouts" in text_of(chrome, "lateness-note"))
    chrome.save_screenshot(str(tmp_path / "page.png"))
    assert (tmp_path / "page.png").stat().st_size > 10_000

    # The search asks the server, which searches every recent end, not just those shown.
    box = chrome.find_element(By.ID, "search")
    box.send_keys("SILENT")
    assert wait(lambda: [r.get_attribute("data-client-id") for r in chrome.find_elements(
        By.CSS_SELECTOR, "#recent-body tr[data-client-id]")] == ["silent-dev"])  # fmt: skip
    box.send_keys("-nobody")
    assert wait(lambda: text_of(chrome, "recent-body") == "none")

    # The list links to the device's own record.
    box.clear()
    box.send_keys(" ")
    assert wait(lambda: listed(chrome, "silent-dev").find_element(By.TAG_NAME, "a").click() or True)
    record = json.loads(chrome.find_element(By.TAG_NAME, "body").text)
    assert record["client_id"] == "silent-dev" and record["reason"] == "keepalive-timeout"
    for sock in devices:
        sock.close()


class PrefixProxy(http.server.ThreadingHTTPServer):
    """A reverse proxy serving the status port under ``/ops/``, as nginx would with
    ``location /ops/ { proxy_pass http://status/; }``, telling the prefix in
    ``X-Forwarded-Prefix`` and, like a proxy that buffers responses, never passing a
    stream on (502)."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.streams_refused = 0
        super().__init__(("127.0.0.1", 0), _ProxyHandler)


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    server: PrefixProxy

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path != "/ops" and not self.path.startswith("/ops/"):
            self.send_error(404)
            return
        path = self.path[len("/ops") :] or "/"
        if path.startswith("/presence/stream"):
            self.server.streams_refused += 1
            self.send_error(502)
            return
        request = urllib.request.Request(f"http://127.0.0.1:{self.server.upstream}{path}")
        request.add_header("X-Forwarded-Prefix", "/ops")
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                status, kind, body = answer.status, answer.headers.get("content-type", ""), answer.read()
        except urllib.error.HTTPError as err:
            status, kind, body = err.code, err.headers.get("content-type", ""), err.read()
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_behind_a_prefix_proxy_that_cuts_the_stream_the_page_polls(start_server: Any, chrome: WebDriver) -> None:
    server: Server = start_server(workers=2, status=True)
    assert server.status_port is not None
    proxy = PrefixProxy(server.status_port)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        devices = [raw_connect(server.port, f"meter-{i}", keep_alive=60) for i in range(5)]
        # Without its trailing slash: the page's URLs resolve by the prefix the proxy told.
        chrome.get(f"http://127.0.0.1:{proxy.server_address[1]}/ops")
        assert wait(lambda: text_of(chrome, "online-count") == "5" and text_of(chrome, "mode") == "polling")
        assert proxy.streams_refused >= 1
        assert chrome.execute_script("return typeof Chart") == "function"  # the vendored library, via the prefix
        row = the_silent_device_is_listed_in_time(chrome, server, "quiet-meter")
        assert row.find_element(By.TAG_NAME, "a").get_attribute("href").endswith("/ops/devices/quiet-meter")
        for sock in devices:
            sock.close()
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_while_the_supervisor_is_stopped_the_page_keeps_its_last_answer_and_says_so(
    start_server: Any, chrome: WebDriver
) -> None:
    server: Server = start_server(workers=2, status=True)
    assert server.status_port is not None
    devices = [raw_connect(server.port, f"valve-{i}", keep_alive=60) for i in range(4)]
    chrome.get(f"http://127.0.0.1:{server.status_port}/")
    assert wait(lambda: text_of(chrome, "online-count") == "4")
    the_silent_device_is_listed_in_time(chrome, server, "stuck-valve")
    os.kill(server.proc.pid, signal.SIGSTOP)  # the supervisor, whose authority holds the registry
    try:
        assert wait(lambda: "did not answer" in text_of(chrome, "counts-note"), timeout=5)
        assert listed(chrome, "stuck-valve") is not None  # the last list stays up
        assert "the registry did not answer since" in text_of(chrome, "recent-note")
        assert text_of(chrome, "mode") == "live"  # the workers still push, their figures current
        assert len(chrome.find_elements(By.CSS_SELECTOR, "#workers-body tr[data-worker]")) == 2
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert wait(lambda: "did not answer" not in text_of(chrome, "counts-note"), timeout=5)
    assert text_of(chrome, "online-count") == "4"
    for sock in devices:
        sock.close()
