"""A reward that holds the run still at a known point, so a test can look at the live dashboard.

Loaded by dotted path inside the reward worker. Its first call of the second step (call 129 of a
128-row step) waits until the test releases the named `Gate` actor, at most `HOLD_S` seconds.
"""
import asyncio

import ray

from mindspeed_rl.rewards.rules import digits

GATE_NAME = "mindspeed_rl_dashboard_test_gate"
ROWS_PER_STEP = 128
HOLD_S = 90.0

_calls = {"n": 0}


@ray.remote(num_cpus=0)
class Gate:
    """Async actor: `wait` returns once `release` was called (or its timeout ran out)."""

    def __init__(self):
        self._open = None

    def _event(self) -> asyncio.Event:
        if self._open is None:
            self._open = asyncio.Event()
        return self._open

    async def wait(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._event().wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def release(self) -> None:
        self._event().set()


def digits_paused_in_second_step(response: str, answer: str, prompt: str = "") -> float:
    _calls["n"] += 1
    if _calls["n"] == ROWS_PER_STEP + 1:
        gate = ray.get_actor(GATE_NAME)
        ray.get(gate.wait.remote(HOLD_S), timeout=HOLD_S + 30)
    return digits(response, answer, prompt)
