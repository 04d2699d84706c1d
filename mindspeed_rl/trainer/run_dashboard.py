"""The run's dashboard and report: the live page while it trains, report.html and dashboard.json at the end.

The Trainer feeds the state (records, step begins and ends); this module starts the server before Ray
(a port in use fails first), describes the run's stages and lanes, and writes the last view, also after
a crash, without ever hiding the run's own error.
"""
from __future__ import annotations

import os
import sys


class DashboardError(RuntimeError):
    """The dashboard cannot be served (the message names the key and the fix)."""


def start_dashboard(cfg, plan):
    """(DashboardState or None, DashboardServer or None) for trainer.dashboard / trainer.report."""
    t = cfg.trainer
    if not (t.dashboard or t.report):
        return None, None
    from ..dashboard import DashboardServer, DashboardState
    state = DashboardState(dashboard_info(cfg, plan))
    if not t.dashboard:
        return state, None
    server = DashboardServer(state.snapshot, port=t.dashboard_port)
    try:
        url = server.start()
    except OSError as e:
        raise DashboardError(f"trainer.dashboard_port={t.dashboard_port}: cannot serve the dashboard on "
                             f"127.0.0.1:{t.dashboard_port} ({e.strerror or e}); pick a free port, 0 for any "
                             "free one, or trainer.dashboard=false") from None
    print(f"dashboard: {url}", file=sys.stderr, flush=True)
    return state, server


def dashboard_info(cfg, plan) -> dict:
    lanes = [{"stage": "dataset", "worker": "driver"}]
    for m in plan.order:
        group = plan.group_of(m.name)
        lanes += [{"stage": m.name, "worker": f"{group}/{rank}"} for rank in range(plan.groups[group].world)]
    producers = {c: m.name for m in plan.order for c in m.output_keys}
    return {"title": os.path.basename(os.path.normpath(cfg.trainer.output_dir)),
            "output_dir": os.path.abspath(cfg.trainer.output_dir), "algorithm": cfg.rl_config.algorithm,
            "blocking": cfg.rl_config.blocking, "placement": cfg.placement.mode,
            "prompts_per_step": cfg.rl_config.prompts_per_step,
            "n_samples_per_prompt": cfg.rl_config.n_samples_per_prompt, "rows_per_step": plan.rows_per_step,
            "total_steps": cfg.trainer.total_steps, "stages": [m.name for m in plan.order],
            "consumers": list(plan.consumers), "columns": list(plan.columns), "producers": producers,
            "lanes": lanes}


def finish_dashboard(state, server, cfg, error: BaseException | None) -> None:
    """The last view of the run (also after a crash): report.html and dashboard.json; stop the server."""
    t = cfg.trainer
    if state is None:
        return
    try:
        state.finish(error)
        if t.report:
            from ..dashboard import write_report
            state.save(t.output_dir)
            path = write_report(state.snapshot(), t.output_dir)
            print(f"report: {path}", file=sys.stderr, flush=True)
    except Exception as e:  # the report must never hide the run's own error
        print(f"writing the report failed: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        if server is not None:
            server.stop()
