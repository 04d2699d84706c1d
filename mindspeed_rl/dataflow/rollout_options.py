"""What the agent rollout and dynamic sampling change in an algorithm's graph, as transforms of its MFC list.

* **loss_mask** (`AlgorithmOptions.loss_mask`: an agent rollout, or `overlong_buffer.drop_truncated`): the
  generate MFC of the trained policy also writes `loss_mask` (1 on the model's tokens, 0 on a tool's
  output or a row left out of the loss), and every MFC that reads the responses to compute log-probs
  against the rollout's (the old log-probs) or to train reads it too. With an agent rollout that MFC
  runs `agent_generate` instead of `generate`.
* **the gate** (`AlgorithmOptions.dynamic_sampling`): every MFC that does not lead to the reward reads the
  column `kept` as well. The driver writes `kept` only for the groups it keeps
  (trainer/dynamic_sampling.py) and retires the others from the dock, so no stage after the reward ever
  takes a dropped group: it waits for `kept`, which never comes for them. `kept` is put by the driver,
  as the dataset's columns are, so it is one of the graph's dataset keys (`gate_keys`).
"""
from __future__ import annotations

import dataclasses

from .mfc import InterfaceType, MFCDef

LOSS_MASK = "loss_mask"
GATE = "kept"
FILTER = "dynamic_sampling"  # the dock consumer the driver reads the rewards through
REWARD = "rm_scores"


def with_loss_mask(mfcs: list[MFCDef], agent: bool) -> list[MFCDef]:
    """`mfcs` with the generate MFC of the trained policy writing `loss_mask` (running `agent_generate` when
    `agent`) and the MFCs that compare log-probs with the rollout's or train reading it."""
    trained = {m.model_name for m in mfcs if m.interface_type is InterfaceType.TRAIN_STEP}
    out = []
    for m in mfcs:
        if m.interface_type is InterfaceType.GENERATE and m.model_name in trained and m.fn in (None, "generate"):
            m = dataclasses.replace(m, output_keys=(*m.output_keys, LOSS_MASK),
                                    fn="agent_generate" if agent else m.fn)
        elif m.model_name in trained and "responses" in m.input_keys and (
                m.interface_type is InterfaceType.TRAIN_STEP
                or (m.interface_type is InterfaceType.INFERENCE and "rollout_log_prob" in m.input_keys)):
            m = dataclasses.replace(m, input_keys=(*m.input_keys, LOSS_MASK))
        out.append(m)
    return out


def with_gate(mfcs: list[MFCDef]) -> list[MFCDef]:
    """`mfcs` with every MFC that the reward does not depend on reading the gate column `kept`."""
    producer = {k: m for m in mfcs for k in m.output_keys}
    if REWARD not in producer:
        raise ValueError(f"rl_config.dynamic_sampling: this algorithm's graph has no {REWARD!r} column to filter "
                         f"groups by (its MFCs: {[m.name for m in mfcs]})")
    upstream, todo = set(), [producer[REWARD]]
    while todo:  # the reward's MFC and everything it reads from: they run before the filter
        m = todo.pop()
        if m.name in upstream:
            continue
        upstream.add(m.name)
        todo += [producer[k] for k in m.input_keys if k in producer]
    return [m if m.name in upstream else dataclasses.replace(m, input_keys=(*m.input_keys, GATE)) for m in mfcs]


def gate_keys(dynamic_sampling: bool) -> tuple[str, ...]:
    """The columns the driver puts beside the dataset's: the gate under dynamic sampling."""
    return (GATE,) if dynamic_sampling else ()
