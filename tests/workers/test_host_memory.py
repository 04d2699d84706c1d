"""A worker's resident memory stops growing over steps of varying prompt lengths (device/host_memory.py): the
rollout and the update run on threads of their own in bf16, as in a worker, what each stage freed goes back to the
kernel after it, and oneDNN's kernel caches are bounded. Without that, glibc's per-thread arenas keep the freed
pieces and the caches a kernel per new shape, and the process grows."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mindspeed_rl.device.host_memory import KERNEL_CACHE_VARIABLES

STEPS = 8
SCRIPT = r"""
import json, sys, threading
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from mindspeed_rl.device.host_memory import bound_kernel_caches, release_free_memory
from mindspeed_rl.engines.base import MicroBatch, OptimConfig, SamplingParams
from mindspeed_rl.engines.rollout.hf_rollout import HFRolloutEngine
from mindspeed_rl.engines.train.torch_train import TorchTrainEngine

release, steps = sys.argv[1] == "release", int(sys.argv[2])
if release:
    bound_kernel_caches()
torch.set_num_threads(2)
config = LlamaConfig(vocab_size=16384, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
                     num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
torch.manual_seed(0)
train = TorchTrainEngine(LlamaForCausalLM(config), 0, OptimConfig(lr=1e-5), dtype=torch.bfloat16)
rollout = HFRolloutEngine(LlamaForCausalLM(config).to(torch.bfloat16), 0)
g = torch.Generator().manual_seed(0)

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

def on_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()))
    t.start()
    t.join()
    if release:
        release_free_memory()
    return out.get("r")

def loss_fn(o, mb):
    return -(o.log_probs * o.response_mask).sum() / o.response_mask.sum(), {}

sizes = []
for step in range(steps):
    prompts = [torch.randint(1, 16384, (int(n),), generator=g) for n in torch.randint(20, 120, (32,), generator=g)]
    params = SamplingParams(max_new_tokens=int(torch.randint(16, 48, (1,), generator=g)))
    got = on_thread(lambda: rollout.generate(prompts, params, list(range(step * 32, step * 32 + 32))))
    on_thread(lambda: train.train_step(iter([MicroBatch({"prompts": prompts[i:i + 16], "responses": got.responses[i:i + 16]},
                                                        0.5, i == 16) for i in (0, 16)]), loss_fn))
    sizes.append(rss_mb())
print(json.dumps(sizes))
"""


def test_resident_bytes_follow_what_the_process_holds():
    import torch

    from mindspeed_rl.device.host_memory import peak_resident_bytes, release_free_memory, resident_bytes
    before = resident_bytes()
    held = torch.ones(64 * 2**20 // 4)          # 64 MiB, every page touched
    during = resident_bytes()
    del held
    release_free_memory()
    after = resident_bytes()
    assert during - before >= 60 * 2**20 and during - after >= 60 * 2**20, (before, during, after)
    assert peak_resident_bytes() >= 0.99 * during   # the kernel's high-water mark lags by a few pages


# bf16 matmuls through oneDNN, one new row count each: malloc's live bytes (glibc's mallinfo2) after each
SHAPES = r"""
import ctypes, json, sys, torch
from mindspeed_rl.device.host_memory import bound_kernel_caches
if sys.argv[1] == "bounded":
    bound_kernel_caches(8)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
torch.manual_seed(0)
linear = torch.nn.Linear(256, 512)
live = []
for rows in range(40, 72):
    x = torch.randn(rows, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear(x)
    y.float().sum().backward()
    del x, y
    linear.zero_grad(set_to_none=True)
    info = libc.mallinfo2()
    live.append((info.uordblks + info.hblkhd) / 2**20)
print(json.dumps(live))
"""


def live_mb_over_new_shapes(bounded: bool) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_CACHE_VARIABLES}
    out = subprocess.run([sys.executable, "-c", SHAPES, "bounded" if bounded else "defaults"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_bounded_kernel_caches_stop_growing_with_new_shapes():
    """oneDNN and ideep keep a kernel per shape (1,024 each by default); a worker bounds them."""
    bounded, defaults = live_mb_over_new_shapes(True), live_mb_over_new_shapes(False)
    assert max(bounded[8:]) - bounded[8] < 0.5, bounded            # level once the caches are full
    assert defaults[-1] - defaults[8] > 10 * (bounded[-1] - bounded[8]) + 10, defaults   # ~1.6 MB a new shape


def resident_mb(release: bool) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_CACHE_VARIABLES}
    out = subprocess.run([sys.executable, "-c", SCRIPT, "release" if release else "keep", str(STEPS)],
                         capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.slow_budget(70, reason="8 steps of generating and training a 20M-parameter Llama in bf16, twice: with "
                                    "the worker's release of freed memory and bounded kernel caches, and without")
def test_resident_memory_stops_growing_when_freed_memory_goes_back():
    kept = resident_mb(release=True)
    assert max(kept[3:]) <= 1.1 * kept[2], kept       # level after the third step, as a worker's must be
    grown = resident_mb(release=False)
    assert grown[-1] > 1.2 * kept[-1], (grown, kept)  # the same work keeps more without it
