"""The host memory of a whole run: every process it starts (driver, Ray's own, workers, the dock), sampled.

    python benchmarks/host_memory.py --json out.json -- python cli/train_grpo.py --config-name grpo_smollm2_arith \\
        trainer.total_steps=12

Runs the command and, every `--every` seconds until it ends, reads the resident memory of it and of all its
descendants (a local Ray started by the driver is its child: GCS, raylet, and the workers under the raylet). Prints
the peak of their sum, each process's peak (by its command line), and what the memory plan estimated for the host
(the `memory cpu (host)` line the run prints), and writes them as JSON.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time

import psutil


def tree_rss(root: psutil.Process) -> dict[int, tuple[str, int]]:
    out = {}
    try:
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return out
    for p in procs:
        try:
            out[p.pid] = (" ".join(p.cmdline())[:80] or p.name(), p.memory_info().rss)
        except psutil.Error:
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--every", type=float, default=1.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root = psutil.Process(proc.pid)
    peak_sum, peaks, lines = 0, {}, []
    import threading
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        now = tree_rss(root)
        peak_sum = max(peak_sum, sum(rss for _, rss in now.values()))
        for pid, (name, rss) in now.items():
            if rss > peaks.get(pid, ("", 0))[1]:
                peaks[pid] = (name, rss)
        time.sleep(args.every)
    reader.join(10)
    estimate = next((m.group(1) for line in lines for m in [re.search(r"memory cpu \(host\).*?peak ([\d.]+ GB)", line)]
                     if m), None)
    top = sorted(peaks.values(), key=lambda x: -x[1])[:12]
    print(f"peak of the run's processes together: {peak_sum / 1e9:.2f} GB; the plan's host estimate: {estimate}")
    for name, rss in top:
        print(f"  {rss / 1e9:6.2f} GB  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(cmd), "exit_code": proc.returncode, "peak_sum_gb": peak_sum / 1e9,
                       "plan_host_estimate": estimate,
                       "process_peaks_gb": [{"process": n, "gb": round(r / 1e9, 3)} for n, r in top]}, f, indent=1)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
