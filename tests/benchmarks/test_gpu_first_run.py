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
@pytest.mark.slow_budget(90, reason="the 0.5B architecture's 151,936-token head on the CPU: two decodes of each "
                         "engine, a weight update and an fsdp train step, each about 20-40 s on 2 cores")
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
    fsdp = checks["fsdp_one_rank_memory"]
    assert fsdp["passed"] and "CUDA" in fsdp["peak_allocated_gb"] and "CUDA" in fsdp["plan_over_measured"]
    # the plan's estimate for the same shapes is computed everywhere: weights, gradients and AdamW's two moments
    # of the fp32 model at least
    plan = fsdp["plan"]
    assert plan["estimate_gb"] >= sum(plan["terms_gb"][f"actor {t}"] for t in ("weights", "grads", "optimizer")) > 0
    ipc = checks["cuda_ipc_sync"]
    assert ipc["passed"] is None and "CUDA" in ipc["note"] and ipc["test"].endswith("packed_and_zero_copy")
