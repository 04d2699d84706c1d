"""Where a run's time goes: a live page the trainer serves, and `report.html` at the end.

`DashboardState` gathers the dock's consumption, its event log and the per-step metrics into one
JSON snapshot; `DashboardServer` serves it on 127.0.0.1 with the page; `write_report` writes the
same page with the snapshot embedded, readable offline. See docs/dashboard.md.
"""
from .report import REPORT_FILE, render_page, write_report
from .server import DashboardServer
from .state import SNAPSHOT_FILE, TIMELINE_STEPS, DashboardState, load_snapshot

__all__ = ["DashboardState", "DashboardServer", "render_page", "write_report", "load_snapshot",
           "REPORT_FILE", "SNAPSHOT_FILE", "TIMELINE_STEPS"]
