"""The HTML report in a real headless browser (Debian's chromium), driven over the DevTools
protocol on a pipe (``--remote-debugging-pipe``: no network, no extra packages).

For each report: the page loads with no console errors, no uncaught exceptions and no failed
loads; every picture decodes; the screenshot is not blank and shows the plots' colours; and
the verdict text is on the page. A control page with deliberate errors proves the checks can
fail.
"""
from __future__ import annotations

import base64
import fcntl
import io
import json
import os
import select
import shutil
import subprocess
import time

import numpy as np
import pytest

import profclass
from profclass import timeline_view as tv
from profclass.html import render_html

from conftest import profile_path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
TIMEOUT_S = 60


def find_chromium() -> str | None:
    env = os.environ.get("CHROMIUM")
    if env and os.access(env, os.X_OK):
        return env
    for name in CHROMIUM_NAMES:
        if shutil.which(name):
            return shutil.which(name)
    return None


class Browser:
    """Headless chromium with the DevTools protocol on fds 3 (commands) and 4 (replies),
    messages separated by NUL bytes."""

    def __init__(self, binary: str, profile_dir: str, width: int = 1300, height: int = 1000):
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def wire_fds():  # in the child: the protocol expects exactly fds 3 and 4
            # move both ends above 4 first, so that neither dup2 clobbers the other
            high_r = fcntl.fcntl(to_child_r, fcntl.F_DUPFD, 10)
            high_w = fcntl.fcntl(from_child_w, fcntl.F_DUPFD, 10)
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--mute-audio",
             "--hide-scrollbars", f"--user-data-dir={profile_dir}", f"--window-size={width},{height}",
             "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(3, 4, to_child_r, from_child_w), preexec_fn=wire_fds)
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict] = []
        self.session = None

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no reply from chromium")
            ready, _, _ = select.select([self._from_child], [], [], left)
            if ready:
                data = os.read(self._from_child, 1 << 20)
                if not data:
                    raise RuntimeError("chromium closed the DevTools pipe")
                self._buf += data
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: dict | None = None, session: bool = True) -> dict:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def wait_for(self, method: str) -> dict:
        deadline = time.monotonic() + TIMEOUT_S
        for ev in self.events:
            if ev["method"] == method:
                return ev
        while True:
            ev = self._read_message(deadline)
            if "method" in ev:
                self.events.append(ev)
                if ev["method"] == method:
                    return ev

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]
        for domain in ("Page.enable", "Runtime.enable", "Log.enable", "Network.enable"):
            self.send(domain)
        self.send("Page.navigate", {"url": url})
        self.wait_for("Page.loadEventFired")

    def problems(self) -> list[str]:
        """Console errors/warnings, uncaught exceptions, failed loads and error log entries."""
        out = []
        for ev in self.events:
            m, p = ev["method"], ev.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning", "assert"):
                out.append(f"console.{p['type']}: " + " ".join(str(a.get("value", a.get("description")))
                                                             for a in p.get("args", [])))
            elif m == "Runtime.exceptionThrown":
                det = p.get("exceptionDetails", {})
                out.append(f"exception: {det.get('text', '')} {det.get('exception', {}).get('description', '')}")
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") in ("error", "warning"):
                out.append(f"log {p['entry']['level']}: {p['entry'].get('text', '')}")
            elif m == "Network.loadingFailed":
                out.append(f"failed load: {p.get('errorText', '')}")
        return out

    def evaluate(self, expression: str):
        res = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                             "awaitPromise": True})
        if "exceptionDetails" in res:
            raise RuntimeError(res["exceptionDetails"].get("text"))
        return res["result"].get("value")

    def screenshot(self) -> np.ndarray:
        from PIL import Image
        height = int(self.evaluate("document.documentElement.scrollHeight"))
        self.send("Emulation.setDeviceMetricsOverride", {"width": 1300, "height": min(height, 8000),
                                                         "deviceScaleFactor": 1, "mobile": False})
        png = base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"])
        return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))

    def close(self) -> None:
        try:
            self.send("Browser.close", session=False)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_child)
        os.close(self._from_child)


@pytest.fixture(scope="module")
def chromium():
    binary = find_chromium()
    if binary is None:
        pytest.skip("chromium is not installed (.ci/run installs Debian's chromium; apt-get install -y chromium)")
    return binary


@pytest.fixture
def browser(chromium, tmp_path):
    b = Browser(chromium, str(tmp_path / "chromium-profile"))
    yield b
    b.close()


def _hex(colour: str) -> np.ndarray:
    return np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])


def _pixels_near(img: np.ndarray, colour: str, tol: int = 12) -> int:
    return int((np.abs(img.astype(int) - _hex(colour)).max(axis=2) <= tol).sum())


def test_the_checks_catch_a_broken_page(browser, tmp_path):
    page = tmp_path / "broken.html"
    page.write_text("<!doctype html><html><body><p>hello</p><img src=\"missing.png\">"
                    "<script>console.error('deliberate'); undefinedFunction();</script></body></html>")
    browser.open(page.as_uri())
    found = browser.problems()
    assert any("deliberate" in p for p in found)
    assert any("undefinedFunction" in p for p in found)
    assert any("failed load" in p or "log error" in p for p in found)
    assert browser.evaluate("[...document.images].every(i => i.complete && i.naturalWidth > 0)") is False
    img = browser.screenshot()
    assert img.std() < 30  # a nearly blank page: the variance check below means something


@pytest.mark.parametrize("name,wall,plot_colour", [
    ("comm_4gpu", "communication", tv.LANE_COLOURS["all_to_all"]),
    ("host_1gpu", "host", tv.LANE_COLOURS["idle"]),
])
def test_report_renders_in_chromium(browser, tmp_path, name, wall, plot_colour):
    d = profclass.diagnose(str(profile_path(name)), keep_timelines=True)
    page = tmp_path / f"{name}.html"
    page.write_text(render_html(d))
    browser.open(page.as_uri())
    assert browser.problems() == []
    # every picture decoded and has a size on the page
    sizes = browser.evaluate("[...document.images].map(i => [i.complete, i.naturalWidth, i.naturalHeight, "
                             "i.getBoundingClientRect().width])")
    assert len(sizes) == 2 and all(c and w > 100 and h > 100 and shown > 300 for c, w, h, shown in sizes)
    text = browser.evaluate("document.body.innerText")
    assert f"{wall.upper()} WALL" in text  # the verdict, styled upper-case
    assert d.verdict["summary"] in text
    assert f"runner-up {d.verdict['runner_up']}" in text
    img = browser.screenshot()
    assert img.shape[0] > 1500 and img.std() > 30  # not blank
    # the plots are drawn: the wall bar's and the timeline's colours are on screen
    assert _pixels_near(img, tv.WALL_COLOURS[wall]) > 2000
    assert _pixels_near(img, plot_colour) > 2000
