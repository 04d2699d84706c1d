// mindspeed_rl dashboard: bars, a Gantt chart of the dock's event log and per-step metric charts.
// Plain JavaScript and SVG, no library, nothing fetched from outside: the same script runs live
// (polling /api/state) and inside report.html (the snapshot embedded in the page).
(function () {
  "use strict";

  var SVGNS = "http://www.w3.org/2000/svg";
  var MODE = document.body.getAttribute("data-mode");
  var PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f",
                 "#ff9da7", "#3b8686", "#8c6d31", "#6b6ecf"];
  var DATASET_COLOR = "#7f8c97";

  // ------------------------------------------------------------------ small helpers
  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    setAttrs(node, attrs);
    append(node, children);
    return node;
  }

  function sv(tag, attrs, children) {
    var node = document.createElementNS(SVGNS, tag);
    setAttrs(node, attrs);
    append(node, children);
    return node;
  }

  function setAttrs(node, attrs) {
    Object.keys(attrs || {}).forEach(function (k) {
      if (attrs[k] !== null && attrs[k] !== undefined) node.setAttribute(k, String(attrs[k]));
    });
  }

  function append(node, children) {
    (Array.isArray(children) ? children : children === undefined ? [] : [children]).forEach(function (c) {
      if (c === null || c === undefined) return;
      node.appendChild(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
    });
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
    return node;
  }

  function fmt(v) {
    if (v === null || v === undefined || !isFinite(v)) return "–";
    var a = Math.abs(v);
    if (a === 0) return "0";
    if (a >= 1e6) return (v / 1e6).toFixed(2) + "M";
    if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
    if (a >= 100) return v.toFixed(0);
    if (a >= 1) return v.toFixed(2);
    if (a >= 0.01) return v.toFixed(3);
    return v.toExponential(1);
  }

  function fmtSeconds(s) {
    if (!isFinite(s)) return "–";
    if (s === 0) return "0";
    if (s >= 100) return s.toFixed(0) + " s";
    if (s >= 1) return s.toFixed(2) + " s";
    return (s * 1000).toFixed(s >= 0.01 ? 0 : 1) + " ms";
  }

  function niceStep(range, target) {
    var raw = range / Math.max(1, target);
    var mag = Math.pow(10, Math.floor(Math.log10(raw)));
    var steps = [1, 2, 2.5, 5, 10];
    for (var i = 0; i < steps.length; i++) if (steps[i] * mag >= raw) return steps[i] * mag;
    return 10 * mag;
  }

  function stageColors(info) {
    var colors = {dataset: DATASET_COLOR};
    (info.stages || []).forEach(function (s, i) { colors[s] = PALETTE[i % PALETTE.length]; });
    return function (stage) {
      if (!(stage in colors)) colors[stage] = PALETTE[Object.keys(colors).length % PALETTE.length];
      return colors[stage];
    };
  }

  // ------------------------------------------------------------------ header
  function renderHeader(s) {
    var info = s.info || {};
    document.getElementById("run-title").textContent = info.title || "";
    var parts = [];
    if (info.algorithm) parts.push(info.algorithm);
    if (info.blocking !== undefined) parts.push(info.blocking ? "blocking" : "non-blocking");
    if (info.placement) parts.push("placement " + info.placement);
    if (info.rows_per_step) parts.push(info.prompts_per_step + " prompts × " + info.n_samples_per_prompt +
                                       " = " + info.rows_per_step + " rows per step");
    if (info.output_dir) parts.push(info.output_dir);
    document.getElementById("run-detail").textContent = parts.join(" · ");
    var status = document.getElementById("run-status");
    var total = info.total_steps;
    var text;
    if (s.status === "running") text = "running · step " + s.step + (total ? " of steps 0–" + (total - 1) : "");
    else if (s.status === "finished") text = "finished · " + (s.history || []).length + " steps";
    else if (s.status === "failed") text = "failed at step " + s.step;
    else text = s.status || "";
    if (MODE === "report") text += " · report of " + new Date(s.now * 1000).toLocaleString();
    status.textContent = text;
    status.className = "status " + (s.status || "");
    status.setAttribute("data-status", s.status || "");
  }

  // ------------------------------------------------------------------ consumption bars
  function renderBars(s, color) {
    var info = s.info || {};
    var stepInfo = (s.steps || {})[String(s.step)];
    var final = stepInfo && stepInfo.t_end;
    var title = s.step === null || s.step === undefined ? "Current step: not started"
      : "Step " + s.step + (final ? " (complete)" : s.status === "running" ? " (in progress)" : " (when the run stopped)");
    document.getElementById("consumption-title").textContent = title;
    var producers = info.producers || {};
    fillBars("consumer-bars", "consumer", order(info.consumers, s.consumers), s.consumers || {}, "taken",
             function (name) { return color(name); });
    fillBars("column-bars", "column", order(info.columns, s.columns), s.columns || {}, "written",
             function (name) { return color(producers[name] || "dataset"); });
    var box = document.getElementById("consumption");
    var old = box.querySelector(".error");
    if (old) old.remove();
    if (s.error) box.appendChild(el("div", {"class": "error"}, s.error));
    else if (s.dock_error) box.appendChild(el("div", {"class": "error"}, "the dock did not answer: " + s.dock_error));
  }

  function order(known, present) {
    var names = (known || []).slice();
    Object.keys(present || {}).forEach(function (n) { if (names.indexOf(n) < 0) names.push(n); });
    return names;
  }

  function fillBars(id, kind, names, status, field, colorOf) {
    var box = clear(document.getElementById(id));
    names.forEach(function (name) {
      var st = status[name] || {};
      var done = st[field] || 0, total = st.total || 0;
      var pct = total ? Math.min(100, 100 * done / total) : 0;
      box.appendChild(el("div", {"class": "bar" + (total && done >= total ? " done" : ""), "data-kind": kind,
                                 "data-name": name, "data-done": done, "data-total": total}, [
        el("span", {"class": "bar-name", title: name}, name),
        el("span", {"class": "track"}, el("span", {"class": "fill",
                                                   style: "width:" + pct.toFixed(1) + "%;background:" + colorOf(name)})),
        el("span", {"class": "bar-value"}, done + " / " + total)
      ]));
    });
  }

  // ------------------------------------------------------------------ timeline
  // One box per micro-batch a stage worker took: it starts when the worker asked the dock (the
  // hatched part is the wait for ready rows) and ends when the worker put the results back, or
  // asked for its next micro-batch, or (for the last one) when its stage call returned. A worker's
  // stage loop is get, compute, put, get, ...: its k-th put of a step belongs to its k-th get (the
  // actor may see a put after the next get, since puts are sent without waiting for the answer).
  function buildLanes(s) {
    var info = s.info || {};
    var lanes = [], byKey = {};
    function lane(stage, worker) {
      var key = stage + "@" + worker;
      if (!byKey[key]) { byKey[key] = {stage: stage, worker: worker, events: [], boxes: []}; lanes.push(byKey[key]); }
      return byKey[key];
    }
    (info.lanes || []).forEach(function (l) { lane(l.stage, l.worker); });
    var events = (s.events || []).slice().sort(function (a, b) { return a.t_start - b.t_start || a.seq - b.seq; });
    events.forEach(function (e) { lane(e.stage, e.worker || "").events.push(e); });
    var spanEnd = {}, spanVersion = {};
    (s.spans || []).forEach(function (sp) {
      spanEnd[sp.step + "|" + sp.stage + "@" + sp.worker] = sp.t_end;
      if (sp.weight_version !== undefined) spanVersion[sp.step + "|" + sp.stage + "@" + sp.worker] = sp.weight_version;
    });
    var steps = s.steps || {};
    lanes.forEach(function (l) {
      var bySteps = {};
      l.events.forEach(function (e) {
        var b = bySteps[e.step] || (bySteps[e.step] = {gets: [], puts: []});
        (e.op === "get" ? b.gets : b.puts).push(e);
      });
      Object.keys(bySteps).map(Number).sort(function (a, b) { return a - b; }).forEach(function (step) {
        var gets = bySteps[step].gets, puts = bySteps[step].puts;
        gets.forEach(function (g, k) {
          var p = puts[k], next = gets[k + 1];
          var end = Math.min(p ? p.t_start : Infinity, next ? next.t_start : Infinity);
          if (end === Infinity) {
            end = spanEnd[step + "|" + l.stage + "@" + l.worker];
            if (end === undefined) end = (steps[String(step)] || {}).t_end || (step === s.step ? s.now : g.t_end);
          }
          l.boxes.push({op: "get", step: step, version: spanVersion[step + "|" + l.stage + "@" + l.worker],
                        rows: g.rows, t0: g.t_start, tw: g.t_end, t1: Math.max(end, g.t_end),
                        put: !!p});
        });
        puts.slice(gets.length).forEach(function (p) {  // puts of a lane that takes nothing (the driver)
          l.boxes.push({op: "put", step: step, rows: p.rows, t0: p.t_start, tw: p.t_start, t1: p.t_start});
        });
      });
    });
    return lanes;
  }

  function renderGantt(s, color) {
    var box = clear(document.getElementById("gantt"));
    var lanes = buildLanes(s);
    var steps = s.steps || {};
    var stepNames = Object.keys(steps).map(Number).sort(function (a, b) { return a - b; });
    document.getElementById("timeline-title").textContent = "Timeline of the last " + (s.timeline_steps || 3) +
      " steps: one lane per stage and worker, one box per micro-batch (from the dock's event log)";
    var t0 = Infinity, t1 = -Infinity;
    stepNames.forEach(function (k) {
      if (steps[k].t_start) t0 = Math.min(t0, steps[k].t_start);
      if (steps[k].t_end) t1 = Math.max(t1, steps[k].t_end);
    });
    lanes.forEach(function (l) { l.boxes.forEach(function (b) { t0 = Math.min(t0, b.t0); t1 = Math.max(t1, b.t1); }); });
    if (s.status === "running" && isFinite(t0)) t1 = Math.max(t1, s.now);
    if (!isFinite(t0) || !lanes.length) {
      box.appendChild(el("div", {"class": "empty"}, "no micro-batch yet"));
      renderLegend(lanes, color);
      renderOverlap(s, lanes, []);
      return;
    }
    if (t1 <= t0) t1 = t0 + 1e-3;
    var W = 1320, LABEL = 250, RIGHT = 14, TOP = 22, LANE = 20, GAP = 5, BOTTOM = 22;
    var H = TOP + lanes.length * (LANE + GAP) + BOTTOM;
    var x = function (t) { return LABEL + (t - t0) / (t1 - t0) * (W - LABEL - RIGHT); };
    var svg = sv("svg", {viewBox: "0 0 " + W + " " + H, "class": "gantt", "data-lanes": lanes.length,
                         "data-t0": t0, "data-t1": t1});
    var defs = sv("defs");
    lanes.forEach(function (l, i) {
      var c = color(l.stage);
      var p = sv("pattern", {id: "hatch" + i, patternUnits: "userSpaceOnUse", width: 5, height: 5,
                             patternTransform: "rotate(45)"}, [
        sv("rect", {width: 5, height: 5, fill: "#fff"}),
        sv("line", {x1: 0, y1: 0, x2: 0, y2: 5, stroke: c, "stroke-width": 2, "stroke-opacity": 0.55})]);
      defs.appendChild(p);
    });
    svg.appendChild(defs);
    // time axis (seconds since the first step shown), labels at the bottom
    var span = t1 - t0, tick = niceStep(span, 12);
    for (var i = 0; i * tick <= span + 1e-9; i++) {
      var tx = x(t0 + i * tick);
      svg.appendChild(sv("line", {x1: tx, x2: tx, y1: TOP - 4, y2: H - BOTTOM + 4, stroke: "#e4e8ec"}));
      svg.appendChild(sv("text", {x: tx, y: H - 6, "font-size": 10, fill: "#6e7781", "text-anchor": "middle"},
                         fmtSeconds(i * tick).replace(" ", "")));
    }
    svg.appendChild(sv("text", {x: 20, y: H - 6, "font-size": 10, fill: "#6e7781"},
                       "time since step " + stepNames[0] + " began →"));
    lanes.forEach(function (l, i) { svg.appendChild(drawLane(l, i, TOP + i * (LANE + GAP), W, LANE, x, color)); });
    drawStepStarts(svg, steps, stepNames, x, TOP, H - BOTTOM);
    box.appendChild(svg);
    renderLegend(lanes, color);
    renderOverlap(s, lanes, stepNames);
  }

  // One lane: its label, then a box per micro-batch (hatched while it waited, solid while it worked).
  function drawLane(l, i, y, W, LANE, x, color) {
    var c = color(l.stage);
    var g = sv("g", {"class": "lane", "data-stage": l.stage, "data-worker": l.worker,
                     "data-boxes": l.boxes.length});
    g.appendChild(sv("rect", {x: 0, y: y - 2, width: W, height: LANE + 4, fill: i % 2 ? "#fafbfc" : "#fff"}));
    g.appendChild(sv("rect", {x: 4, y: y + 4, width: 10, height: LANE - 8, rx: 2, fill: c}));
    g.appendChild(sv("text", {"class": "lane-label", x: 20, y: y + LANE / 2 + 4, "font-size": 12, fill: "#1f2328"}, [
      sv("tspan", {"font-weight": 600}, l.stage), sv("tspan", {fill: "#6e7781"}, "  " + (l.worker || "?"))]));
    l.boxes.forEach(function (b) { g.appendChild(drawBox(l, b, i, y, LANE, x, c)); });
    return g;
  }

  function drawBox(l, b, i, y, LANE, x, c) {
    var mb = sv("g", {"class": "mb", "data-op": b.op, "data-step": b.step, "data-rows": b.rows,
                      "data-t0": b.t0, "data-tw": b.tw, "data-t1": b.t1});
    var xs = x(b.t0), xw = x(b.tw), xe = x(b.t1);
    if (b.op === "put") {
      mb.appendChild(sv("rect", {"class": "work", x: xs - 1, y: y + 2, width: 3, height: LANE - 4, fill: c}));
    } else {
      if (xw - xs >= 0.5) {
        mb.appendChild(sv("rect", {"class": "wait", x: xs, y: y + 2, width: xw - xs, height: LANE - 4,
                                   fill: "url(#hatch" + i + ")", stroke: c, "stroke-opacity": 0.4,
                                   "stroke-width": 0.6}));
      }
      mb.appendChild(sv("rect", {"class": "work", x: xw, y: y + 2, width: Math.max(1.5, xe - xw), height: LANE - 4,
                                 fill: c, stroke: "#fff", "stroke-width": 0.8}));
      if (b.put) mb.appendChild(sv("rect", {x: xe - 1, y: y, width: 2, height: LANE, fill: "#1f2328"}));
    }
    var what = b.op === "put" ? "put " + b.rows + " rows" :
      b.rows + " rows: waited " + fmtSeconds(b.tw - b.t0) + ", then " + fmtSeconds(b.t1 - b.tw) +
      (b.put ? " until it put its results" : "");
    // with rl_config.max_weight_staleness > 0 a rollout lane works on a later step than the trainer's
    // lanes, with older weights: the title says which step and which weight version
    mb.appendChild(sv("title", {}, l.stage + " @ " + (l.worker || "?") + ", step " + b.step +
                                   (b.version !== undefined ? " (weights v" + b.version + ")" : "") + ": " + what));
    return mb;
  }

  // A dashed line where each step began, with its number on top.
  function drawStepStarts(svg, steps, stepNames, x, TOP, bottom) {
    stepNames.forEach(function (k) {
      var st = steps[k];
      if (!st.t_start) return;
      var sx = x(st.t_start);
      svg.appendChild(sv("line", {"class": "step-start", x1: sx, x2: sx, y1: TOP - 4, y2: bottom,
                                  stroke: "#22303c", "stroke-dasharray": "4 3", "stroke-width": 1}));
      svg.appendChild(sv("text", {x: sx + 3, y: TOP - 8, "font-size": 11, "font-weight": 600, fill: "#22303c"},
                         "step " + k));
    });
  }

  function renderLegend(lanes, color) {
    var legend = clear(document.getElementById("gantt-legend"));
    var seen = {};
    lanes.forEach(function (l) {
      if (seen[l.stage]) return;
      seen[l.stage] = true;
      legend.appendChild(el("span", {"class": "key"}, [el("span", {"class": "swatch", style: "background:" + color(l.stage)}),
                                                      l.stage]));
    });
    legend.appendChild(el("span", {"class": "key"}, [el("span", {"class": "swatch wait"}), "waiting for ready rows"]));
    legend.appendChild(el("span", {"class": "key"}, [el("span", {"class": "swatch put"}), "results put back"]));
  }

  // Per step: wall time, the stage workers' summed compute and wait; compute / wall > 1 means overlap.
  function renderOverlap(s, lanes, stepNames) {
    var box = clear(document.getElementById("overlap"));
    if (!stepNames.length) return;
    var steps = s.steps || {};
    var table = el("table", {"class": "overlap"});
    table.appendChild(el("tr", {}, ["step", "wall", "stage compute (sum)", "waiting (sum)", "compute / wall"].map(
      function (h) { return el("th", {}, h); })));
    stepNames.forEach(function (k) {
      var st = steps[k];
      if (!st.t_start) return;
      var end = st.t_end || s.now;
      var work = 0, wait = 0;
      lanes.forEach(function (l) {
        l.boxes.forEach(function (b) { if (b.step === k && b.op === "get") { work += b.t1 - b.tw; wait += b.tw - b.t0; } });
      });
      var wall = end - st.t_start;
      table.appendChild(el("tr", {"class": "overlap-row", "data-step": k, "data-ratio": (work / wall).toFixed(3)}, [
        el("td", {}, String(k) + (st.t_end ? "" : " (running)")), el("td", {}, fmtSeconds(wall)),
        el("td", {}, fmtSeconds(work)), el("td", {}, fmtSeconds(wait)), el("td", {}, "×" + (work / wall).toFixed(2))]));
    });
    box.appendChild(table);
  }

  // ------------------------------------------------------------------ per-step charts
  // The charts come with the snapshot (info.charts: the registered step metrics' charts, dataflow/metrics.py):
  // a key with {stage} stands for each stage, any other {name} for the keys the records hold in its place.
  function chartSpecs(s) {
    var stages = (s.info || {}).stages || [];
    var seen = [], known = {};
    (s.history || []).forEach(function (r) {
      Object.keys(r).forEach(function (k) { if (!known[k]) { known[k] = true; seen.push(k); } });
    });
    return ((s.info || {}).charts || []).map(function (spec) {
      var keys = [];
      spec.keys.forEach(function (pattern) {
        expandKey(pattern, stages, seen).forEach(function (k) { if (keys.indexOf(k) < 0) keys.push(k); });
      });
      return {title: spec.title, keys: keys, stageKeys: spec.stageKeys};
    });
  }

  function expandKey(pattern, stages, seen) {
    if (pattern.indexOf("{stage}") >= 0) return stages.map(function (x) { return pattern.replace("{stage}", x); });
    if (pattern.indexOf("{") < 0) return [pattern];
    var parts = pattern.split(/\{[^}]*\}/).map(function (p) { return p.replace(/[.*+?^$()|[\]\\]/g, "\\$&"); });
    var re = new RegExp("^" + parts.join("[^/]+") + "$");
    return seen.filter(function (k) { return re.test(k); });
  }

  function renderCharts(s, color) {
    var box = clear(document.getElementById("charts"));
    var history = s.history || [];
    if (!history.length) {
      box.appendChild(el("div", {"class": "empty"}, "no step finished yet"));
      return;
    }
    chartSpecs(s).forEach(function (spec) {
      var keys = spec.keys.filter(function (k) { return history.some(function (r) { return k in r; }); });
      if (!keys.length) return;
      box.appendChild(lineChart(spec.title, keys, history, function (k, i) {
        return spec.stageKeys ? color(k.split("/")[1]) : PALETTE[i % PALETTE.length];
      }));
    });
  }

  function lineChart(title, keys, history, colorOf) {
    var W = 420, H = 190, L = 52, R = 10, T = 10, B = 26;
    var xs = history.map(function (r) { return r.step; });
    var xmin = Math.min.apply(null, xs), xmax = Math.max.apply(null, xs);
    if (xmax === xmin) { xmin -= 0.5; xmax += 0.5; }
    var ymin = Infinity, ymax = -Infinity;
    keys.forEach(function (k) {
      history.forEach(function (r) { if (k in r) { ymin = Math.min(ymin, r[k]); ymax = Math.max(ymax, r[k]); } });
    });
    if (ymax === ymin) { var pad = Math.abs(ymax) * 0.1 || 1; ymin -= pad; ymax += pad; }
    var ystep = niceStep(ymax - ymin, 4);
    ymin = Math.floor(ymin / ystep) * ystep;
    ymax = Math.ceil(ymax / ystep) * ystep;
    var px = function (v) { return L + (v - xmin) / (xmax - xmin) * (W - L - R); };
    var py = function (v) { return H - B - (v - ymin) / (ymax - ymin) * (H - T - B); };
    var svg = sv("svg", {viewBox: "0 0 " + W + " " + H, "class": "chart", "data-title": title,
                         "data-points": history.length});
    var nticks = Math.round((ymax - ymin) / ystep);
    for (var i = 0; i <= nticks; i++) {
      var v = Math.round((ymin + i * ystep) / ystep * 1e6) / 1e6 * ystep;  // no drift from summing steps
      svg.appendChild(sv("line", {x1: L, x2: W - R, y1: py(v), y2: py(v), stroke: "#eceff3"}));
      svg.appendChild(sv("text", {x: L - 5, y: py(v) + 3, "font-size": 10, fill: "#6e7781", "text-anchor": "end"},
                         fmt(Math.abs(v) < ystep * 1e-6 ? 0 : v)));
    }
    var xstep = Math.max(1, niceStep(xmax - xmin, 6));
    for (var xv = Math.ceil(xmin / xstep) * xstep; xv <= xmax; xv += xstep) {
      svg.appendChild(sv("text", {x: px(xv), y: H - B + 14, "font-size": 10, fill: "#6e7781", "text-anchor": "middle"},
                         String(Math.round(xv))));
    }
    svg.appendChild(sv("text", {x: W - R, y: H - 3, "font-size": 10, fill: "#6e7781", "text-anchor": "end"}, "step"));
    svg.appendChild(sv("line", {x1: L, x2: L, y1: T, y2: H - B, stroke: "#9aa4ae"}));
    svg.appendChild(sv("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: "#9aa4ae"}));
    var legend = keys.length > 1 ? el("div", {"class": "legend chart-legend"}) : null;
    keys.forEach(function (k, i) {
      var c = colorOf(k, i);
      var pts = history.filter(function (r) { return k in r; });
      var last = pts[pts.length - 1][k];
      svg.appendChild(sv("polyline", {"class": "series", "data-key": k, "data-points": pts.length, "data-last": last,
                                      points: pts.map(function (r) { return px(r.step).toFixed(1) + "," + py(r[k]).toFixed(1); }).join(" "),
                                      fill: "none", stroke: c, "stroke-width": 1.8}));
      if (pts.length <= 60) {
        pts.forEach(function (r) {
          svg.appendChild(sv("circle", {cx: px(r.step), cy: py(r[k]), r: 2.4, fill: c},
                             sv("title", {}, k + " at step " + r.step + ": " + fmt(r[k]))));
        });
      }
      if (legend) {
        legend.appendChild(el("span", {"class": "key"}, [el("span", {"class": "swatch", style: "background:" + c}),
                                                        k.slice(k.indexOf("/") + 1) + " " + fmt(last)]));
      }
    });
    var lastKey = keys[0], lastRow = history.filter(function (r) { return lastKey in r; }).pop();
    return el("div", {"class": "chart-box"}, [
      el("h3", {}, title + (keys.length === 1 && lastRow ? ": " + fmt(lastRow[lastKey]) + " at step " + lastRow.step : "")),
      legend, svg]);
  }

  // ------------------------------------------------------------------ what the model answers
  // s.samples: {"val": the latest validation's first rows, "train": the latest training steps' rows}, each row
  // {prompt, response, answer, reward, step or weight_version} (trainer/samples.py; all rows are in samples/)
  function renderSamples(s) {
    var box = clear(document.getElementById("samples-tables"));
    var samples = s.samples || {}, shown = 0;
    [["val", "Validation (the latest)"], ["train", "Training (the latest steps)"]].forEach(function (kv) {
      var rows = samples[kv[0]] || [];
      if (!rows.length) return;
      shown += rows.length;
      box.appendChild(el("h3", {}, kv[1]));
      var table = el("table", {"class": "samples", "data-kind": kv[0]});
      table.appendChild(el("tr", {}, [kv[0] === "val" ? "weights" : "step", "prompt", "response", "answer",
                                      "reward"].map(function (h) { return el("th", {}, h); })));
      rows.forEach(function (r) {
        table.appendChild(el("tr", {"class": "sample-row"}, [
          el("td", {}, String(kv[0] === "val" ? r.weight_version : r.step)), el("td", {"class": "text"}, r.prompt),
          el("td", {"class": "text"}, r.response), el("td", {}, r.answer), el("td", {}, fmt(r.reward))]));
      });
      box.appendChild(table);
    });
    var section = document.getElementById("samples");
    if (section && section.style) section.style.display = shown ? "" : "none";
  }

  // ------------------------------------------------------------------ main
  function render(s) {
    var color = stageColors(s.info || {});
    renderHeader(s);
    renderBars(s, color);
    renderGantt(s, color);
    renderCharts(s, color);
    renderSamples(s);
    document.body.setAttribute("data-rendered", String(s.now));
  }

  function poll() {
    fetch("api/state", {cache: "no-store"})
      .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
      .then(function (s) {
        render(s);
        setTimeout(poll, s.status === "running" || s.status === "starting" ? 1000 : 5000);
      })
      .catch(function (err) {
        var status = document.getElementById("run-status");
        status.textContent = "disconnected (" + err.message + "); retrying";
        status.className = "status disconnected";
        setTimeout(poll, 2000);
      });
  }

  var embedded = JSON.parse(document.getElementById("snapshot").textContent);
  if (MODE === "report" && embedded) render(embedded);
  else poll();
})();
