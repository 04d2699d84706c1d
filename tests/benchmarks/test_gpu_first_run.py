"""benchmarks/gpu_first_run.py on the CPU: the checks that run without CUDA pass, the others say they were
skipped (the GPU run is the script itself on a GPU machine)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_first_run  # noqa: E402


@pytest.mark.slow
def test_the_cpu_checks_pass_and_the_cuda_ones_say_skipped(tmp_path):
    out = tmp_path / "r.json"
    code = gpu_first_run.main(["--device", "cpu", "--layers", "1", "--rows", "8", "--prompt", "12", "--new", "12",
                               "--width-step", "8", "--json", str(out)])
    checks = json.loads(out.read_text())["checks"]
    assert code == 0, checks
    static = checks["static_decode"]
    assert static["passed"] and all(s["tokens_equal"] for s in static["settings"].values())
    assert any(s["width_moves"] for s in static["settings"].values())
    assert checks["updated_weights"]["passed"]
    assert checks["concurrent_capture"]["passed"] is None and "CUDA" in checks["concurrent_capture"]["note"]
    assert checks["fsdp_one_rank_memory"]["passed"] and "CUDA" in checks["fsdp_one_rank_memory"]["peak_allocated_gb"]
