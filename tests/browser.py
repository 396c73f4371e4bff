"""Chromium driven over the DevTools protocol, for the report's tests: open a page, take a screenshot,
collect console errors and every request the page makes (on a pipe: no port, no extra package)."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import io
import json
import os
import queue
import shutil
import subprocess
import threading
import time
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--remote-debugging-pipe"]


class Browser:
    """Chromium driven over the DevTools protocol on fds 3 (commands in) and 4 (replies out)."""

    def __init__(self, profile: Path) -> None:
        to_child, from_parent = os.pipe()
        from_child, to_parent = os.pipe()
        # Above 10 so that placing them on 3 and 4 in the child cannot clobber one with the other.
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (to_child, to_parent)]

        def place() -> None:
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        self.proc = subprocess.Popen([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     preexec_fn=place, pass_fds=(3, 4))
        for fd in (to_child, to_parent, *high):
            os.close(fd)
        self._out, self._in = os.fdopen(from_parent, "wb"), os.fdopen(from_child, "rb")
        self._messages: queue.Queue = queue.Queue()
        self.events: list[dict] = []
        self._id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buffer = b""
        while chunk := self._in.read1(1 << 16):
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for message in messages:
                self._messages.put(json.loads(message))

    def call(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 20) -> dict:
        self._id += 1
        message = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        self._out.write(json.dumps(message).encode() + b"\0")
        self._out.flush()
        deadline = time.monotonic() + timeout
        while True:
            reply = self._messages.get(timeout=max(0.01, deadline - time.monotonic()))
            if reply.get("id") == self._id:
                assert "error" not in reply, reply
                return reply["result"]
            self.events.append(reply)

    def wait_for(self, method: str, session: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method and e.get("sessionId") == session for e in self.events):
            self.events.append(self._messages.get(timeout=max(0.01, deadline - time.monotonic())))

    def settle(self, seconds: float) -> None:
        """Collect what the page still logs shortly after it loaded (timers, late errors)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                self.events.append(self._messages.get(timeout=left))
            except queue.Empty:
                break

    def open(self, path: Path, width: int = 1280, height: int = 2000) -> dict:
        """Load a page; its screenshot (PNG bytes), console errors, outside requests and a few DOM facts."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page", "Network"):
            self.call(f"{domain}.enable", session=session)
        self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                          "mobile": False}, session)
        url = path.resolve().as_uri()
        self.call("Page.navigate", {"url": url}, session)
        self.wait_for("Page.loadEventFired", session)
        self.settle(0.3)
        mine = [e for e in self.events if e.get("sessionId") == session]
        errors = [e for e in mine if e["method"] == "Runtime.exceptionThrown"
                  or (e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "assert"))
                  or (e["method"] == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")]
        requests = [e["params"]["request"]["url"] for e in mine if e["method"] == "Network.requestWillBeSent"]
        facts = self.call("Runtime.evaluate", {"returnByValue": True, "expression": (
            "({svgs: document.querySelectorAll('section svg').length,"
            " sections: [...document.querySelectorAll('section')].map(s => s.id),"
            " scrollWidth: document.documentElement.scrollWidth})")}, session)["result"].get("value")
        png = base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"}, session)["data"])
        self.call("Target.closeTarget", {"targetId": target})
        return {"png": png, "errors": errors, "outside": [u for u in requests if u != url], "facts": facts}

    def close(self) -> None:
        with contextlib.suppress(queue.Empty, OSError, AssertionError):
            self.call("Browser.close", timeout=5)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def not_blank(png: bytes) -> None:
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert image.size == (1280, 2000)
    colours = image.getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 50, "hardly any colours: a blank or broken page"
    small = image.resize((128, 200))
    inked = sum(1 for x in range(128) for y in range(200) if min(small.getpixel((x, y))) < 200)
    # A blank or unstyled page inks well under 1%; a bench's page whose first screen is mostly its text
    # (the busy-machine note, the bytes' sources) inked 4.9% of the cells, its plots further down.
    assert inked > 0.03 * 128 * 200, f"only {inked} non-white cells of {128 * 200}"
