"""The page, live or as a self-contained `report.html`.

One page serves both: `static/page.html` with `static/dashboard.css` and `static/dashboard.js`
inlined. Live, the script polls `/api/state`; in a report the snapshot is embedded as JSON and
nothing is fetched, so the file opens offline, from disk, on a machine without network (no CDN,
no external library: the charts are hand-written SVG).
"""
from __future__ import annotations

import html
import json
import os
import re
from importlib import resources
from pathlib import Path

from ..dataflow.metrics import chart_specs

REPORT_FILE = "report.html"


def _static(name: str) -> str:
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


def _embed_json(data: dict) -> str:
    # inside <script type="application/json">: "<" escaped so "</script>" in a string cannot end it
    return json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")


def render_page(snapshot: dict | None) -> str:
    """The page's HTML: live (polls /api/state) when `snapshot` is None, else a static report."""
    mode = "live" if snapshot is None else "report"
    if snapshot is not None and "charts" not in snapshot.get("info", {}):  # a snapshot saved without its charts
        snapshot = {**snapshot, "info": {**snapshot.get("info", {}), "charts": chart_specs()}}
    title = "mindspeed_rl dashboard" if snapshot is None else \
        f"mindspeed_rl report: {snapshot.get('info', {}).get('title', '')}"
    values = {"TITLE": html.escape(title), "MODE": mode, "CSS": _static("dashboard.css"),
              "SNAPSHOT": _embed_json(snapshot) if snapshot is not None else "null", "JS": _static("dashboard.js")}
    # one pass: text put in (a snapshot, the script) is never scanned for placeholders again
    return re.sub(r"\{\{([A-Z]+)\}\}", lambda m: values[m.group(1)], _static("page.html"))


def write_report(snapshot: dict, run_dir: str | os.PathLike) -> Path:
    """Write `run_dir/report.html` with the snapshot embedded; returns its path."""
    path = Path(run_dir) / REPORT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_page(snapshot), encoding="utf-8")
    os.replace(tmp, path)
    return path
