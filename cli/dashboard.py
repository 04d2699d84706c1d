"""Serve a run's dashboard again: `python cli/dashboard.py <run_dir> [--port N] [--write-only]`.

It reads `<run_dir>/dashboard.json` (which the trainer keeps up to date every step, so a run that
crashed or was killed has one too), rewrites `<run_dir>/report.html` from it with this version's
page, and serves the page on 127.0.0.1 until Ctrl-C. `--write-only` writes the report and exits.
A missing, unreadable or corrupt dashboard.json, or a run directory it cannot write to, is one line
on stderr naming the file, what is wrong and what to do, and exit code 2.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mindspeed_rl.dashboard import DashboardServer, load_snapshot, write_report  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run's trainer.output_dir (holds dashboard.json)")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default 0: any free port)")
    parser.add_argument("--write-only", action="store_true", help="write report.html and exit, serve nothing")
    args = parser.parse_args(argv)
    try:
        snapshot = load_snapshot(args.run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"dashboard: {e}", file=sys.stderr)
        return 2
    try:
        path = write_report(snapshot, args.run_dir)
    except OSError as e:
        print(f"dashboard: cannot write {e.filename or args.run_dir} ({e.strerror or e}); copy the run "
              "directory somewhere writable and run this there", file=sys.stderr)
        return 2
    print(f"report: {path}", flush=True)
    if args.write_only:
        return 0
    server = DashboardServer(lambda: snapshot, port=args.port)
    try:
        url = server.start()
    except OSError as e:
        print(f"dashboard: cannot serve on 127.0.0.1:{args.port} ({e.strerror or e}); pick another --port, "
              "or 0 for any free one", file=sys.stderr)
        return 2
    print(f"dashboard: {url} (Ctrl-C to stop)", flush=True)
    server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
