"""The report's validation chart: dashboard.js run by Node on a report snapshot whose records carry val/*
every few steps, in a DOM just large enough for it (the browser tests need Chromium; this needs Node)."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from mindspeed_rl.dashboard.report import _static
from mindspeed_rl.dataflow.metrics import chart_specs

NODE = shutil.which("node") or shutil.which("nodejs")

FAKE_DOM = r"""
function Node(tag) { this.tag = tag; this.attrs = {}; this.children = []; this._text = ""; this.className = ""; this.style = {}; }
Node.prototype.setAttribute = function (k, v) { this.attrs[k] = String(v); };
Node.prototype.getAttribute = function (k) { return k in this.attrs ? this.attrs[k] : null; };
Node.prototype.appendChild = function (c) { this.children.push(c); return c; };
Node.prototype.removeChild = function (c) { this.children.splice(this.children.indexOf(c), 1); return c; };
Node.prototype.querySelector = function (sel) {  // ".class" only
  var hit = null, name = sel.slice(1);
  (function walk(n) { n.children.forEach(function (c) {
    if (!hit && ((c.attrs["class"] || c.className || "").split(" ").indexOf(name) >= 0)) hit = c;
    if (!hit) walk(c); }); })(this);
  return hit;
};
Object.defineProperty(Node.prototype, "firstChild", {get: function () { return this.children[0] || null; }});
Object.defineProperty(Node.prototype, "textContent", {
  get: function () { return this._text + this.children.map(function (c) { return c.textContent; }).join(""); },
  set: function (v) { this.children = []; this._text = String(v); }});
var byId = {};
var document = {
  body: new Node("body"),
  createElement: function (t) { return new Node(t); },
  createElementNS: function (ns, t) { return new Node(t); },
  createTextNode: function (t) { var n = new Node("#text"); n._text = t; return n; },
  getElementById: function (id) { return byId[id] || (byId[id] = new Node("div")); }
};
document.body.setAttribute("data-mode", "report");
"""

DUMP = r"""
function walk(n, f) { f(n); n.children.forEach(function (c) { walk(c, f); }); }
var charts = {};
walk(byId["charts"], function (n) {
  if (n.tag !== "svg" || !n.attrs["data-title"]) return;
  var series = {};
  walk(n, function (p) { if (p.tag === "polyline") series[p.attrs["data-key"]] = +p.attrs["data-points"]; });
  charts[n.attrs["data-title"]] = series;
});
console.log(JSON.stringify(charts));
"""


def _snapshot(steps: int, every: int) -> dict:
    history = []
    for s in range(steps):
        rec = {"step": s, "reward/mean": 0.1 + s / steps, "timing/step": 0.2}
        if (s + 1) % every == 0:
            rec.update({"val/reward_mean": 0.1 + s / steps, "val/pass@1": s / steps, "val/pass@4": 0.5,
                        "val/weight_version": float(s + 1)})
        history.append(rec)
    return {"info": {"title": "t", "stages": [], "charts": chart_specs()}, "status": "finished", "step": steps - 1, "now": 0.0,
            "history": history, "consumers": {}, "columns": {}, "events": [], "spans": [], "steps": {}}


def _charts(snapshot: dict) -> dict:
    script = (FAKE_DOM + f"document.getElementById('snapshot').textContent = {json.dumps(json.dumps(snapshot))};\n"
              + _static("dashboard.js") + DUMP)
    out = subprocess.run([NODE, "-e", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_validation_has_its_own_chart_with_a_point_per_validation():
    charts = _charts(_snapshot(steps=12, every=4))
    assert charts["Validation (held-out prompts)"] == {"val/reward_mean": 3, "val/pass@1": 3, "val/pass@4": 3}
    assert charts["Reward"]["reward/mean"] == 12
    assert "Validation (held-out prompts)" not in _charts(_snapshot(steps=5, every=100))  # no validation: no chart


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_a_registered_metric_is_drawn_without_a_line_of_script():
    from mindspeed_rl.dataflow.metrics import STEP_METRICS, StepMetric, register_metric
    register_metric(StepMetric("response_length/min", chart="Shortest response"))
    try:
        snapshot = _snapshot(steps=5, every=100)
    finally:
        STEP_METRICS.pop("response_length/min")
    for rec in snapshot["history"]:
        rec["response_length/min"] = 1.0
    assert _charts(snapshot)["Shortest response"] == {"response_length/min": 5}
