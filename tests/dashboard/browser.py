"""Headless Chromium from the command line, and reading the page it rendered.

`dump_dom` returns the DOM after the page's scripts ran (as a person's browser would show it);
`screenshot` saves a PNG; `read_page` turns the DOM into the numbers a person reads off it.
The flags keep Chromium off the network (here nothing outside is reachable, and a headless
Chromium that tries hangs on the connection).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from html.parser import HTMLParser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NO_CHROMIUM = "chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars"]


def _run(args: list[str], workdir: str, timeout: float = 60.0) -> str:
    profile = tempfile.mkdtemp(prefix="chromium-profile-", dir=workdir)
    proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own process group: chromium and its helpers
        proc.communicate()
        raise AssertionError(f"chromium did not finish within {timeout:.0f} s: {' '.join(args)}") from None
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    if proc.returncode != 0:
        raise AssertionError(f"chromium exited with {proc.returncode}: {err[-2000:]}")
    return out


def dump_dom(url: str, workdir: str, budget_ms: int = 4000, offline: bool = False) -> str:
    """The DOM after `budget_ms` of (virtual) time: scripts ran, fetches answered. `offline`: every
    network request goes to a dead proxy, so a page that needs anything from a network breaks."""
    cut = ["--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=<-loopback>"] if offline else []
    return _run([*cut, f"--virtual-time-budget={budget_ms}", "--dump-dom", url], workdir)


def screenshot(url: str, path: str, workdir: str, size: tuple[int, int] = (1400, 1400), budget_ms: int = 4000) -> str:
    _run([f"--virtual-time-budget={budget_ms}", f"--window-size={size[0]},{size[1]}", f"--screenshot={path}", url],
         workdir)
    assert os.path.getsize(path) > 10_000, f"{path}: screenshot is nearly empty"
    return path


def png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


# ---------------------------------------------------------------------- the DOM as a tree
class Node:
    def __init__(self, tag: str, attrs: dict, parent: "Node | None"):
        self.tag, self.attrs, self.parent = tag, attrs, parent
        self.children: list[Node | str] = []

    @property
    def classes(self) -> set[str]:
        return set((self.attrs.get("class") or "").split())

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def find_all(self, tag: str | None = None, cls: str | None = None, **attrs) -> list["Node"]:
        out = []
        for c in self.children:
            if isinstance(c, Node):
                if (tag is None or c.tag == tag) and (cls is None or cls in c.classes) and \
                        all(c.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items()):
                    out.append(c)
                out += c.find_all(tag, cls, **attrs)
        return out

    def find(self, tag: str | None = None, cls: str | None = None, **attrs) -> "Node":
        found = self.find_all(tag, cls, **attrs)
        assert found, f"no <{tag or '*'} class={cls!r} {attrs}> in the page"
        return found[0]


VOID = {"meta", "link", "br", "img", "input", "hr", "col", "area", "base", "source", "wbr"}


class _Tree(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = self.cur = Node("#document", {}, None)

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs), self.cur)
        self.cur.children.append(node)
        if tag not in VOID:
            self.cur = node

    def handle_startendtag(self, tag, attrs):
        self.cur.children.append(Node(tag, dict(attrs), self.cur))

    def handle_endtag(self, tag):
        node = self.cur
        while node is not None and node.tag != tag:
            node = node.parent
        if node is not None and node.parent is not None:
            self.cur = node.parent

    def handle_data(self, data):
        self.cur.children.append(data)


def parse(html: str) -> Node:
    tree = _Tree()
    tree.feed(html)
    tree.close()
    return tree.root


def read_page(html: str) -> dict:
    """What the page shows: status, bars (as their visible text says), lanes with their boxes, charts."""
    root = parse(html)
    bars: dict[str, dict[str, tuple[int, int]]] = {"consumer": {}, "column": {}}
    for bar in root.find_all(cls="bar"):
        value = bar.find(cls="bar-value").text()
        done, total = (int(x) for x in value.split("/"))
        assert (str(done), str(total)) == (bar.attrs["data-done"], bar.attrs["data-total"]), value
        name = bar.find(cls="bar-name").text()
        assert name == bar.attrs["data-name"]
        bars[bar.attrs["data-kind"]][name] = (done, total)
    lanes = {}
    for lane in root.find_all("g", cls="lane"):
        boxes = [(b.attrs["data-op"], int(b.attrs["data-step"]), int(b.attrs["data-rows"]))
                 for b in lane.find_all("g", cls="mb")]
        assert len(boxes) == int(lane.attrs["data-boxes"])
        label = lane.find("text", cls="lane-label").text()
        assert lane.attrs["data-stage"] in label and lane.attrs["data-worker"] in label, label
        lanes[(lane.attrs["data-stage"], lane.attrs["data-worker"])] = boxes
    charts = {svg.attrs["data-title"]: {s.attrs["data-key"]: int(s.attrs["data-points"])
                                        for s in svg.find_all("polyline", cls="series")}
              for svg in root.find_all("svg", cls="chart")}
    status = root.find(id="run-status")
    return {"status": status.attrs.get("data-status"), "status_text": status.text(),
            "step_title": root.find(id="consumption-title").text(),
            "consumers": bars["consumer"], "columns": bars["column"], "lanes": lanes, "charts": charts,
            "overlap": {int(r.attrs["data-step"]): float(r.attrs["data-ratio"])
                        for r in root.find_all("tr", cls="overlap-row")}}
