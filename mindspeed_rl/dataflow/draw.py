"""Pictures of a dataflow graph: SVG written by hand (no graphviz), PNG through matplotlib.

`layout` places the graph once as a list of shapes (boxes, paths, texts); `to_svg` and `write_png`
only render those shapes, so the two formats show the same picture.

The layout is layered by topological depth, left to right: the "dataset" source in column 0, each
MFC one column right of its deepest producer. Edges that skip columns pass through placeholder
slots in the columns between (a small Sugiyama layout), the order within a column is chosen by
barycenter sweeps that keep the fewest crossings, and edge labels are placed where they hit no box
and no other label. Version edges (weights carried to the next step) loop under the graph, dashed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

import networkx as nx

from .graph import data_graph, dataset_readers, topological_order, version_edges

__all__ = ["Drawing", "layout", "to_svg", "write_svg", "write_png", "draw", "INTERFACE_COLORS"]

# interface type -> (fill, stroke)
INTERFACE_COLORS = {
    "generate": ("#dbeafe", "#2563eb"),
    "inference": ("#dcfce7", "#16a34a"),
    "train_step": ("#ffedd5", "#ea580c"),
    "compute": ("#f3e8ff", "#9333ea"),
}
DATASET_COLORS = ("#f1f5f9", "#475569")
DATA_EDGE_COLOR = "#475569"
VERSION_EDGE_COLOR = "#dc2626"
TEXT_COLOR = "#0f172a"
MUTED_TEXT = "#475569"

MONO_FONTS = "DejaVu Sans Mono, Menlo, Consolas, monospace"
SANS_FONTS = "DejaVu Sans, Helvetica, Arial, sans-serif"
CHAR_W = 0.61            # monospace advance per font-size unit (DejaVu Sans Mono: 0.602)
SANS_CHAR_W = 0.58       # rough average for the sans-serif legend text

NAME_SIZE, SUB_SIZE, LABEL_SIZE = 13, 11, 10.5
NODE_H, NODE_PAD_X = 46, 14
DUMMY_H, GAP_Y = 14, 26
MARGIN, TITLE_H = 24, 48
ARROW_LEN, ARROW_HALF = 8, 4


# --------------------------------------------------------------------------------------------- shapes
@dataclass
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str
    stroke: str | None = None
    stroke_width: float = 1.0
    rx: float = 0.0
    opacity: float = 1.0
    tooltip: str | None = None
    css_class: str | None = None


@dataclass
class Path:
    """cmds: ("M", x, y), ("L", x, y), ("C", x1, y1, x2, y2, x, y), ("Q", x1, y1, x, y)."""
    cmds: list
    stroke: str
    width: float = 1.4
    dash: tuple | None = None
    css_class: str | None = None


@dataclass
class Polygon:
    points: list
    fill: str


@dataclass
class Text:
    x: float
    y: float            # baseline
    text: str
    size: float
    color: str = TEXT_COLOR
    bold: bool = False
    anchor: str = "middle"  # start | middle | end
    mono: bool = True


@dataclass
class Drawing:
    width: float
    height: float
    title: str
    items: list = field(default_factory=list)


def _text_w(text: str, size: float, mono: bool = True) -> float:
    return len(text) * size * (CHAR_W if mono else SANS_CHAR_W)


# --------------------------------------------------------------------------------------------- layout
@dataclass
class _Node:
    name: str
    layer: int
    w: float
    h: float
    kind: str                 # "mfc" | "dataset" | "dummy"
    lines: tuple = ()
    cx: float = 0.0
    cy: float = 0.0

    @property
    def left(self):
        return self.cx - self.w / 2

    @property
    def right(self):
        return self.cx + self.w / 2

    @property
    def top(self):
        return self.cy - self.h / 2

    @property
    def bottom(self):
        return self.cy + self.h / 2


def _crossings(layers, chains):
    pos = {n: i for layer in layers for i, n in enumerate(layer)}
    by_gap: dict[int, list] = {}
    lay = {n: li for li, layer in enumerate(layers) for n in layer}
    for chain in chains:
        for a, b in zip(chain, chain[1:]):
            by_gap.setdefault(lay[a], []).append((pos[a], pos[b]))
    total = 0
    for pairs in by_gap.values():
        for i in range(len(pairs)):
            for j in range(i + 1, len(pairs)):
                (a, b), (c, d) = pairs[i], pairs[j]
                if (a - c) * (b - d) < 0:
                    total += 1
    return total


def _order_layers(layers, chains, sweeps=8):
    preds: dict[str, list] = {n: [] for layer in layers for n in layer}
    succs: dict[str, list] = {n: [] for layer in layers for n in layer}
    for chain in chains:
        for a, b in zip(chain, chain[1:]):
            succs[a].append(b)
            preds[b].append(a)
    best = [list(layer) for layer in layers]
    best_cross = _crossings(best, chains)
    for sweep in range(sweeps):
        down = sweep % 2 == 0
        rng = range(1, len(layers)) if down else range(len(layers) - 2, -1, -1)
        for li in rng:
            ref = layers[li - 1] if down else layers[li + 1]
            refpos = {n: i for i, n in enumerate(ref)}
            nbrs = preds if down else succs
            cur = {n: i for i, n in enumerate(layers[li])}
            bary = {}
            for n in layers[li]:
                ps = [refpos[p] for p in nbrs[n] if p in refpos]
                bary[n] = sum(ps) / len(ps) if ps else cur[n]
            layers[li].sort(key=lambda n: (bary[n], cur[n]))
        cross = _crossings(layers, chains)
        if cross < best_cross:
            best, best_cross = [list(layer) for layer in layers], cross
    return best


def _cubic(p0, p1, p2, p3, t):
    u = 1 - t
    return tuple(u ** 3 * a + 3 * u * u * t * b + 3 * u * t * t * c + t ** 3 * d
                 for a, b, c, d in zip(p0, p1, p2, p3))


def _overlap(a, b):
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return w * h if w > 0 and h > 0 else 0.0


def layout(g: nx.DiGraph, title: str | None = None) -> Drawing:
    """Place graph `g` as shapes; `title` defaults to the graph's ``name`` attribute."""
    order = topological_order(g)
    nodes, layers, edges, chains = _nodes_and_chains(g, order)
    col_cx, col_w, content_right = _coordinates(nodes, layers, edges)
    vedges = version_edges(g)
    out_y, in_y = _ports(nodes, chains, vedges)
    labels = _Labels([(nd.left - 3, nd.top - 3, nd.right + 3, nd.bottom + 3)
                      for nd in nodes.values() if nd.kind != "dummy"])
    items: list = []
    graph_bottom = _version_edge_items(items, labels, nodes, vedges, out_y, in_y)
    _data_edge_items(items, labels, nodes, edges, chains, out_y, in_y, col_cx, col_w)
    items.extend(_box_items(g, nodes))
    items.extend(labels.items)
    name = title if title is not None else g.graph.get("name")
    heading = f"{name.upper()} dataflow graph" if name else "dataflow graph"
    items.append(Text(MARGIN, MARGIN + 16, heading, 17, bold=True, anchor="start", mono=False))
    items.append(Text(MARGIN, MARGIN + 34, f"{len(order)} MFCs (model function calls); edge labels are the "
                      f"dock columns an MFC reads", 11.5, MUTED_TEXT, anchor="start", mono=False))
    width = max(content_right + MARGIN + 16 + 10 * len(vedges), _text_w(heading, 17, False) + 2 * MARGIN)
    height = _legend_items(items, width, graph_bottom + 34) + 7 + MARGIN
    return Drawing(width, height, heading, items)


def _nodes_and_chains(g: nx.DiGraph, order: list) -> tuple[dict, list, list, list]:
    """(boxes by name, the layers' names in drawing order, edges (from, to, label), each edge's chain of boxes
    through a placeholder per layer it crosses). The dataset is layer 0; each MFC lies one right of its
    deepest producer; the dataset's edges come first, then the data edges in topological order."""
    topo = {m.name: i for i, m in enumerate(order)}
    dg = data_graph(g)
    dataset_keys = tuple(g.graph["dataset_keys"])
    layer_of = {"dataset": 0}
    for m in order:
        layer_of[m.name] = 1 + max((layer_of[p] for p in dg.predecessors(m.name)), default=0)
    nodes: dict[str, _Node] = {}
    ds_lines = ("dataset",) + dataset_keys
    ds_w = max(_text_w(ds_lines[0], NAME_SIZE), *(_text_w(k, SUB_SIZE) for k in dataset_keys)) + 2 * NODE_PAD_X
    nodes["dataset"] = _Node("dataset", 0, ds_w, 24 + 15 * len(dataset_keys), "dataset", ds_lines)
    for m in order:
        sub = f"{m.model_name} · {m.interface_type.value}"
        w = max(_text_w(m.name, NAME_SIZE), _text_w(sub, SUB_SIZE), 110) + 2 * NODE_PAD_X
        nodes[m.name] = _Node(m.name, layer_of[m.name], w, NODE_H, "mfc", (m.name, sub))
    edges = [("dataset", name, ", ".join(keys)) for name, keys in dataset_readers(g).items()]
    edges += sorted(((u, v, ", ".join(d["keys"])) for u, v, d in g.edges(data=True) if d["kind"] == "data"),
                    key=lambda e: (topo[e[0]], topo[e[1]]))
    layers: list[list[str]] = [[] for _ in range(max(layer_of.values()) + 1)]
    layers[0].append("dataset")
    for m in order:
        layers[layer_of[m.name]].append(m.name)
    chains = []
    for i, (u, v, _) in enumerate(edges):
        chain = [u]
        for li in range(layer_of[u] + 1, layer_of[v]):
            dummy = f"__edge{i}_{li}"
            nodes[dummy] = _Node(dummy, li, 0.0, DUMMY_H, "dummy")
            layers[li].append(dummy)
            chain.append(dummy)
        chain.append(v)
        chains.append(chain)
    return nodes, _order_layers(layers, chains), edges, chains


def _coordinates(nodes: dict, layers: list, edges: list) -> tuple[list[float], list[float], float]:
    """Set each box's centre: columns left to right, a column's boxes centred vertically. Returns the columns'
    centres and widths and the right edge of the last column."""
    label_w = max((_text_w(lab, LABEL_SIZE) for _, _, lab in edges), default=60)
    gap_x = min(max(150, label_w + 56), 320)
    col_w = [max([nodes[n].w for n in layer] + [40]) for layer in layers]
    heights = [sum(nodes[n].h for n in layer) + GAP_Y * (len(layer) - 1) for layer in layers]
    max_h = max(heights)
    top0 = MARGIN + TITLE_H
    x = MARGIN
    col_cx = []
    for li, layer in enumerate(layers):
        cx = x + col_w[li] / 2
        col_cx.append(cx)
        y = top0 + (max_h - heights[li]) / 2
        for n in layer:
            nodes[n].cx, nodes[n].cy = cx, y + nodes[n].h / 2
            y += nodes[n].h + GAP_Y
        x += col_w[li] + gap_x
    return col_cx, col_w, x - gap_x


def _ports(nodes: dict, chains: list, vedges: list) -> tuple[dict, dict]:
    """(out, in): per box, the y of each edge leaving / entering it, spread over its side in the order of the
    other end's y (version edges last)."""
    out_ports: dict[str, list] = {}
    in_ports: dict[str, list] = {}
    for ci, chain in enumerate(chains):
        out_ports.setdefault(chain[0], []).append((nodes[chain[1]].cy, ci))
        in_ports.setdefault(chain[-1], []).append((nodes[chain[-2]].cy, ci))
    for vi, (u, v, _) in enumerate(vedges):
        out_ports.setdefault(u, []).append((float("inf"), ("v", vi)))
        in_ports.setdefault(v, []).append((float("inf"), ("v", vi)))

    def spread(ports, node):
        ports = sorted(ports, key=lambda p: (p[0], str(p[1])))
        k = len(ports)
        step = min(10.0, node.h * 0.7 / max(k - 1, 1))
        return {key: node.cy + (i - (k - 1) / 2) * step for i, (_, key) in enumerate(ports)}

    return ({n: spread(p, nodes[n]) for n, p in out_ports.items()},
            {n: spread(p, nodes[n]) for n, p in in_ports.items()})


class _Labels:
    """Edge labels, each put at the first candidate point where it overlaps no box and no earlier label (else
    where it overlaps least, boxes weighing 4x)."""

    def __init__(self, boxes: list):
        self.boxes = boxes
        self.placed: list = []
        self.items: list = []

    def place(self, text: str, candidates: list, color: str) -> None:
        w, h = _text_w(text, LABEL_SIZE) + 8, LABEL_SIZE + 6
        best, best_cost = None, None
        for (px, py) in candidates:
            rect = (px - w / 2, py - h / 2, px + w / 2, py + h / 2)
            cost = sum(_overlap(rect, b) for b in self.boxes) * 4 + sum(_overlap(rect, b) for b in self.placed)
            if best_cost is None or cost < best_cost:
                best, best_cost = rect, cost
            if cost == 0:
                break
        self.placed.append(best)
        x0, y0, x1, y1 = best
        self.items.append(Rect(x0, y0, x1 - x0, y1 - y0, "#ffffff", None, rx=3, opacity=0.9))
        self.items.append(Text((x0 + x1) / 2, (y0 + y1) / 2 + LABEL_SIZE * 0.35, text, LABEL_SIZE, color))


def _version_edge_items(items: list, labels: _Labels, nodes: dict, vedges: list, out_y: dict, in_y: dict) -> float:
    """The version edges, looping under every box (drawn first, their labels placed first); returns the y below
    the lowest loop."""
    bottom = max(nd.bottom for nd in nodes.values())
    r = 8.0
    vlabels = []
    for vi, (u, v, model) in enumerate(vedges):
        su, sv = nodes[u], nodes[v]
        y0, y1 = out_y[u][("v", vi)], in_y[v][("v", vi)]
        xa = su.right + 16 + 10 * vi
        xb = sv.left - 16 - 10 * vi
        yb = bottom + 30 + 24 * vi
        cmds = [("M", su.right, y0), ("L", xa - r, y0), ("Q", xa, y0, xa, y0 + r), ("L", xa, yb - r),
                ("Q", xa, yb, xa - r, yb), ("L", xb + r, yb), ("Q", xb, yb, xb, yb - r), ("L", xb, y1 + r),
                ("Q", xb, y1, xb + r, y1), ("L", sv.left - ARROW_LEN, y1)]
        items.append(Path(cmds, VERSION_EDGE_COLOR, 1.6, dash=(6, 4), css_class="version-edge"))
        items.append(_arrow(sv.left, y1, VERSION_EDGE_COLOR))
        vlabels.append((f"weights: {model}", ((xa + xb) / 2, yb)))
    for text, pt in vlabels:
        labels.place(text, [pt], VERSION_EDGE_COLOR)
    return bottom + (30 + 24 * len(vedges) if vedges else 0)


def _data_edge_items(items: list, labels: _Labels, nodes: dict, edges: list, chains: list, out_y: dict,
                     in_y: dict, col_cx: list, col_w: list) -> None:
    """The data edges: curves between columns, straight through a placeholder's slot; each label at the
    first free point along its edge."""
    for ci, ((u, v, text), chain) in enumerate(zip(edges, chains)):
        pts = [(nodes[u].right, out_y[u][ci])]
        for d in chain[1:-1]:
            li = nodes[d].layer
            pts += [(col_cx[li] - col_w[li] / 2, nodes[d].cy), (col_cx[li] + col_w[li] / 2, nodes[d].cy)]
        end = (nodes[v].left, in_y[v][ci])
        pts.append((end[0] - ARROW_LEN, end[1]))
        cmds = [("M",) + pts[0]]
        segments = []
        for i, (a, b) in enumerate(zip(pts, pts[1:])):
            if i % 2 == 1:       # straight pass through a placeholder slot
                cmds.append(("L",) + b)
                segments.append(("L", a, b))
            else:
                mx = (a[0] + b[0]) / 2
                cmds.append(("C", mx, a[1], mx, b[1]) + b)
                segments.append(("C", a, (mx, a[1]), (mx, b[1]), b))
        items.append(Path(cmds, DATA_EDGE_COLOR, 1.3, css_class="data-edge"))
        items.append(_arrow(end[0], end[1], DATA_EDGE_COLOR))
        labels.place(text, _label_points(segments), MUTED_TEXT)


def _label_points(segments: list) -> list[tuple[float, float]]:
    """Candidate label points along an edge's segments, the middle of each first."""
    candidates = []
    for seg in segments:
        for t in (0.5, 0.38, 0.62, 0.26, 0.74, 0.15, 0.85):
            if seg[0] == "L":
                (ax, ay), (bx, by) = seg[1], seg[2]
                candidates.append((ax + (bx - ax) * t, ay + (by - ay) * t))
            else:
                candidates.append(_cubic(*seg[1:], t))
    return candidates


def _box_items(g: nx.DiGraph, nodes: dict) -> list:
    """The dataset's box (its keys listed) and each MFC's (name, model and interface), colored by interface."""
    items: list = []
    dataset_keys = tuple(g.graph["dataset_keys"])
    for nd in nodes.values():
        if nd.kind == "dummy":
            continue
        if nd.kind == "dataset":
            fill, stroke = DATASET_COLORS
            tip = "dataset: " + ", ".join(dataset_keys)
        else:
            m = g.nodes[nd.name]["mfc"]
            fill, stroke = INTERFACE_COLORS[m.interface_type.value]
            tip = (f"{m.name} (model {m.model_name}, {m.interface_type.value})\n"
                   f"in: {', '.join(m.input_keys)}\nout: {', '.join(m.output_keys) or '-'}")
        items.append(Rect(nd.left, nd.top, nd.w, nd.h, fill, stroke, 1.6, rx=9, tooltip=tip,
                          css_class=nd.kind))
        if nd.kind == "dataset":
            y = nd.top + 18
            items.append(Text(nd.cx, y, nd.lines[0], NAME_SIZE, bold=True))
            for k in nd.lines[1:]:
                y += 15
                items.append(Text(nd.cx, y, k, SUB_SIZE, MUTED_TEXT))
        else:
            items.append(Text(nd.cx, nd.cy - 3, nd.lines[0], NAME_SIZE, bold=True))
            items.append(Text(nd.cx, nd.cy + 13, nd.lines[1], SUB_SIZE, MUTED_TEXT))
    return items


def _legend_items(items: list, width: float, ly: float) -> float:
    """The legend from `ly` down, wrapped at `width`; returns the y of its last row."""
    legend_entries = [("box", INTERFACE_COLORS[t], t) for t in INTERFACE_COLORS]
    legend_entries.append(("box", DATASET_COLORS, "dataset"))
    legend_entries.append(("line", None, "data edge: columns read"))
    legend_entries.append(("dash", None, "version edge: weights for the next step"))
    lx = MARGIN
    for kind, colors, text in legend_entries:
        w = 34 + _text_w(text, 11.5, False) + 22
        if lx + w > width - MARGIN and lx > MARGIN:
            lx, ly = MARGIN, ly + 22
        if kind == "box":
            items.append(Rect(lx, ly - 7, 24, 14, colors[0], colors[1], 1.4, rx=4))
        else:
            color = DATA_EDGE_COLOR if kind == "line" else VERSION_EDGE_COLOR
            items.append(Path([("M", lx, ly), ("L", lx + 18, ly)], color, 1.5,
                              dash=(5, 3) if kind == "dash" else None))
            items.append(_arrow(lx + 26, ly, color))
        items.append(Text(lx + 32, ly + 4, text, 11.5, TEXT_COLOR, anchor="start", mono=False))
        lx += w
    return ly


def _arrow(x, y, color):
    """Arrowhead pointing right with its tip at (x, y)."""
    return Polygon([(x, y), (x - ARROW_LEN, y - ARROW_HALF), (x - ARROW_LEN, y + ARROW_HALF)], color)


# --------------------------------------------------------------------------------------------- SVG
def _f(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


def _path_d(cmds) -> str:
    return " ".join(c[0] + " " + " ".join(_f(v) for v in c[1:]) for c in cmds)


def to_svg(g: nx.DiGraph, title: str | None = None) -> str:
    """The picture of `g` as an SVG document (a string)."""
    d = layout(g, title)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_f(d.width)}" height="{_f(d.height)}" '
           f'viewBox="0 0 {_f(d.width)} {_f(d.height)}">',
           f"<title>{escape(d.title)}</title>",
           f'<rect x="0" y="0" width="{_f(d.width)}" height="{_f(d.height)}" fill="#ffffff"/>']
    for it in d.items:
        if isinstance(it, Rect):
            attrs = (f'x="{_f(it.x)}" y="{_f(it.y)}" width="{_f(it.w)}" height="{_f(it.h)}" rx="{_f(it.rx)}" '
                     f'fill="{it.fill}"')
            if it.stroke:
                attrs += f' stroke="{it.stroke}" stroke-width="{_f(it.stroke_width)}"'
            if it.opacity != 1.0:
                attrs += f' fill-opacity="{it.opacity}"'
            if it.css_class:
                attrs += f' class="{it.css_class}"'
            if it.tooltip:
                out.append(f"<rect {attrs}><title>{escape(it.tooltip)}</title></rect>")
            else:
                out.append(f"<rect {attrs}/>")
        elif isinstance(it, Path):
            attrs = f'd="{_path_d(it.cmds)}" fill="none" stroke="{it.stroke}" stroke-width="{_f(it.width)}"'
            if it.dash:
                attrs += f' stroke-dasharray="{" ".join(_f(v) for v in it.dash)}"'
            if it.css_class:
                attrs += f' class="{it.css_class}"'
            out.append(f"<path {attrs}/>")
        elif isinstance(it, Polygon):
            pts = " ".join(f"{_f(x)},{_f(y)}" for x, y in it.points)
            out.append(f'<polygon points="{pts}" fill="{it.fill}"/>')
        elif isinstance(it, Text):
            fam = MONO_FONTS if it.mono else SANS_FONTS
            weight = ' font-weight="bold"' if it.bold else ""
            out.append(f'<text x="{_f(it.x)}" y="{_f(it.y)}" font-family="{fam}" font-size="{_f(it.size)}"'
                       f'{weight} fill="{it.color}" text-anchor="{it.anchor}">{escape(it.text)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_svg(g: nx.DiGraph, path: str, title: str | None = None) -> str:
    """Write the SVG picture of `g` to `path` (parent folders are created); returns `path`."""
    _make_parent(path)
    with open(path, "w", encoding="utf-8") as f:
        f.write(to_svg(g, title))
    return path


# --------------------------------------------------------------------------------------------- PNG
def write_png(g: nx.DiGraph, path: str, title: str | None = None, scale: float = 2.0) -> str:
    """Write a PNG picture of `g` (`scale` pixels per layout unit). Needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.patches import FancyBboxPatch, PathPatch
        from matplotlib.patches import Polygon as MplPolygon
        from matplotlib.path import Path as MplPath
    except ImportError as e:
        raise ImportError("PNG output needs matplotlib, which is not installed: pip install matplotlib "
                          "(or write an .svg, which needs nothing)") from e

    d = layout(g, title)
    dpi = 100.0
    pt = 72.0 / dpi  # one layout unit in points
    fig = plt.figure(figsize=(d.width / dpi, d.height / dpi), dpi=dpi)
    try:
        ax = fig.add_axes((0, 0, 1, 1))
        ax.set_xlim(0, d.width)
        ax.set_ylim(d.height, 0)
        ax.axis("off")
        fig.patch.set_facecolor("#ffffff")
        z = 1
        for it in d.items:
            z += 1
            if isinstance(it, Rect):
                style = f"round,pad=0,rounding_size={it.rx}" if it.rx else "square,pad=0"
                ax.add_patch(FancyBboxPatch((it.x, it.y), it.w, it.h, boxstyle=style, facecolor=it.fill,
                                            edgecolor=it.stroke or "none", linewidth=it.stroke_width * pt,
                                            alpha=None if it.opacity == 1.0 else it.opacity, zorder=z))
            elif isinstance(it, Path):
                verts, codes = [], []
                for c in it.cmds:
                    n_pts = {"M": 1, "L": 1, "Q": 2, "C": 3}[c[0]]
                    code = {"M": MplPath.MOVETO, "L": MplPath.LINETO, "Q": MplPath.CURVE3,
                            "C": MplPath.CURVE4}[c[0]]
                    verts += [c[1 + 2 * i:3 + 2 * i] for i in range(n_pts)]
                    codes += [code] * n_pts
                lw = it.width * pt
                style = (0, tuple(v * pt / lw for v in it.dash)) if it.dash else "solid"
                ax.add_patch(PathPatch(MplPath(verts, codes), facecolor="none", edgecolor=it.stroke,
                                       linewidth=lw, linestyle=style, zorder=z))
            elif isinstance(it, Polygon):
                ax.add_patch(MplPolygon(it.points, closed=True, facecolor=it.fill, edgecolor="none", zorder=z))
            elif isinstance(it, Text):
                ax.text(it.x, it.y, it.text, fontsize=it.size * pt, color=it.color,
                        fontweight="bold" if it.bold else "normal", ha={"start": "left", "end": "right"}.get(
                            it.anchor, "center"), va="baseline",
                        family="monospace" if it.mono else "sans-serif", zorder=z)
        _make_parent(path)
        fig.savefig(path, dpi=dpi * scale, facecolor="#ffffff")
    finally:
        plt.close(fig)
    return path


def draw(g: nx.DiGraph, path: str, fmt: str | None = None, title: str | None = None) -> str:
    """Write the picture of `g` to `path` as `fmt` ("svg" or "png"; default: from the suffix, else svg)."""
    if fmt is None:
        fmt = "png" if path.lower().endswith(".png") else "svg"
    fmt = fmt.lower()
    if fmt == "svg":
        return write_svg(g, path, title)
    if fmt == "png":
        return write_png(g, path, title)
    raise ValueError(f"unknown picture format {fmt!r}; use 'svg' or 'png'")


def _make_parent(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
