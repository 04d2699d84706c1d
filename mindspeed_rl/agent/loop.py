"""The agent loop: multi-turn rollouts with tool calls, on any rollout engine (hf, vllm).

Per row, up to `max_turns` turns: generate until a stop (the end of the response, or the marker that
closes a tool call, `syntax.py`), read the call, run the tool (`runner.py`: in a thread, bounded by a
timeout, any failure an error result), append the result's tokens, generate again. The response
holds the whole trajectory; `loss_mask` is 1 on the model's tokens and 0 on the tools' (verl's
`response_mask` of multi-turn rollouts), and the rollout log-prob of a tool token is 0.

Rows that wait on a tool do not stall the others: each round generates, in one batch, every row that
is ready (its tool answered, or it has just started), while the tools of the other rows run. A row
never waits for another row's tool, only for its own.

Deterministic: turn t of a row samples with a seed derived from the row's seed and t (turn 0 with
the row's seed itself, so a row that calls no tool is exactly the plain rollout's). The engines
sample a row's tokens from its seed and its own context alone, whichever batch it is in, so a
trajectory depends only on (row seed, the tools' answers), not on which rows shared a batch or when
a tool answered: runs are reproducible under `rl_config.guarantee_order`.

`max_new_tokens` bounds the whole trajectory (model and tool tokens): a tool result is cut to what
is left of it.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from .runner import STATUSES, PendingCall, ToolRunner
from .syntax import CallSyntax
from .tools import Tool


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of a row's turn `turn`: the row's own seed at turn 0, a hash of (seed, turn) after."""
    if turn == 0:
        return int(seed)
    return int(np.random.SeedSequence([int(seed) % 2**63, int(turn)]).generate_state(1, dtype=np.uint64)[0] >> 1)


@dataclass
class AgentRollout:
    """One agent rollout's rows, in the order of the prompts."""
    responses: list[torch.Tensor]    # the trajectory's tokens (int64)
    log_probs: list[torch.Tensor]    # float32 per token: the sampled token's log-prob, 0 on tool tokens
    loss_masks: list[torch.Tensor]   # int8 per token: 1 on the model's tokens, 0 on the tools'
    turns: list[int]                 # generate turns per row
    truncated: list[bool]            # cut by max_new_tokens (or max_turns) without finishing
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATUSES, 0))  # tool calls by status


class AgentLoop:
    """Multi-turn rollouts of `engine` with `tools` called in `syntax`.

    Args:
        engine: a `RolloutEngine` (anything with `generate(prompts, params, seeds) -> Rollout`).
        tokenizer: the model's tokenizer (decodes a turn to read its call, encodes the results).
        tools: {name the model calls it by: function} (`tools.get_tools`).
        syntax: how calls and results are written (`syntax.get_syntax`).
        max_turns: generate turns per row at most; a call in the last turn is not run.
        tool_timeout_s: seconds a tool call may take before it is answered with a timeout error.
        tool_choice: a tool's name: every trajectory starts with that tool's opening marker, given, not
            sampled (loss_mask 0), so the model's first turn is a call of it (OpenAI's `tool_choice`
            forcing a function); None: the model decides.
        return_direct: tools whose result is the trajectory's final answer (LangChain's `return_direct`):
            once such a tool answers (status ok), the loop writes its result text after the result as
            the answer, then the end-of-response token, all given (loss_mask 0), and the row ends. A
            failed call of it is an error result like any other, and the model goes on.
    """

    def __init__(self, engine, tokenizer, tools: dict[str, Tool], syntax: CallSyntax, max_turns: int,
                 tool_timeout_s: float, tool_choice: str | None = None, return_direct: Sequence[str] = ()):
        if max_turns < 1:
            raise ValueError(f"generate_config.agent.max_turns={max_turns}; it must be >= 1")
        if not tools:
            raise ValueError("generate_config.agent.tools is empty; name at least one tool (e.g. [calc])")
        self.engine, self.tokenizer, self.syntax, self.max_turns = engine, tokenizer, syntax, int(max_turns)
        self.runner = ToolRunner(tools, syntax, tool_timeout_s)
        if tool_choice is not None and tool_choice not in tools:
            raise ValueError(f"generate_config.agent.tool_choice={tool_choice!r} is not one of the tools "
                             f"{sorted(tools)}; name one of them, or null to let the model decide")
        self.opener = [] if tool_choice is None else self.encode(syntax.opener(tool_choice))
        unknown = sorted(set(return_direct) - set(tools))
        if unknown:
            raise ValueError(f"generate_config.agent.return_direct={list(return_direct)!r}: {unknown} are not among "
                             f"the tools {sorted(tools)}; name tools of generate_config.agent.tools")
        self.return_direct = frozenset(return_direct)
        self.call_end_ids = set()
        for marker in syntax.call_ends(list(tools)):
            ids = tokenizer.encode(marker, add_special_tokens=False)
            if len(ids) != 1:
                raise ValueError(f"generate_config.agent: the call marker {marker!r} is {len(ids)} tokens of this "
                                 f"tokenizer ({ids}); the rollout stops on it, so it must be one token: use a "
                                 "tokenizer that has it as a token (Qwen2.5 has </tool_call>: syntax json; "
                                 "builtin:tiny-qwen2-tool has </calc>: syntax tags)")
            self.call_end_ids.add(int(ids[0]))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def end_ids(self, params) -> list[int]:
        """The token a return_direct answer ends with: the tokenizer's end of sequence when it is one of
        the rollout's stops, else the first stop (none: the answer alone)."""
        stops = list(params.stop_token_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return [eos] if eos in stops else stops[:1]

    def run(self, prompts: Sequence[torch.Tensor], params, seeds: Sequence[int]) -> AgentRollout:
        """Trajectories for `prompts` sampled with `params` (`max_new_tokens` bounds each trajectory),
        row i seeded by `seeds[i]`."""
        if len(seeds) != len(prompts):
            raise ValueError(f"agent rollout: {len(prompts)} prompts but {len(seeds)} seeds; one seed per row")
        n = len(prompts)
        stops = tuple(sorted(set(params.stop_token_ids) | self.call_end_ids))
        finals = set(params.stop_token_ids) - self.call_end_ids  # stops that end a response
        prompts = [torch.as_tensor(p).reshape(-1).long() for p in prompts]
        tokens: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        mask: list[list[int]] = [[] for _ in range(n)]
        turns, budget = [0] * n, [int(params.max_new_tokens)] * n
        finished = [False] * n
        calls = dict.fromkeys(STATUSES, 0)
        for r in range(n):  # a forced call's opening marker: given, not sampled
            given = self.opener[:budget[r]]
            tokens[r] += given
            lps[r] += [0.0] * len(given)
            mask[r] += [0] * len(given)
            budget[r] -= len(given)
        turn_start = [0] * n  # where each row's current turn begins (a given opener belongs to the turn)
        ready, pending = list(range(n)), {}  # rows to generate now; rows waiting on their tool
        while ready or pending:
            if ready:
                batch, ready = sorted(ready), []
                p = dataclasses.replace(params, stop_token_ids=stops, max_new_tokens=max(budget[r] for r in batch))
                contexts = [torch.cat([prompts[r], torch.tensor(tokens[r], dtype=torch.long)]) for r in batch]
                out = self.engine.generate(contexts, p, [turn_seed(seeds[r], turns[r]) for r in batch])
                for r, toks, logp in zip(batch, out.responses, out.log_probs):
                    toks = torch.as_tensor(toks).reshape(-1)[:budget[r]].tolist()
                    tokens[r] += toks
                    lps[r] += torch.as_tensor(logp, dtype=torch.float32).reshape(-1)[:len(toks)].tolist()
                    mask[r] += [1] * len(toks)
                    turns[r] += 1
                    budget[r] -= len(toks)
                    last = toks[-1] if toks else None
                    if last in finals:
                        finished[r] = True
                    elif last in self.call_end_ids and turns[r] < self.max_turns and budget[r] > 0:
                        turn = self.tokenizer.decode(tokens[r][turn_start[r]:], skip_special_tokens=False)
                        pending[r] = self.runner.start(turn)
            ToolRunner.wait_any(pending.values(), block=not ready)
            now = time.monotonic()
            for r in sorted(pending):
                call: PendingCall = pending[r]
                if not call.finished(now):
                    continue
                del pending[r]
                status, text = call.outcome(self.syntax, self.runner.timeout_s)
                calls[status] += 1
                direct = status == "ok" and call.call.name in self.return_direct
                given = self.encode(text)
                if direct:  # the result is the answer: written for the model, then the end of the response
                    given += self.encode(call.future.result()[1]) + self.end_ids(params)
                obs = given[:budget[r]]
                tokens[r] += obs
                lps[r] += [0.0] * len(obs)
                mask[r] += [0] * len(obs)
                budget[r] -= len(obs)
                turn_start[r] = len(tokens[r])
                if direct:
                    finished[r] = len(obs) == len(given)
                elif budget[r] > 0:
                    ready.append(r)
        return AgentRollout(
            responses=[torch.tensor(t, dtype=torch.long) for t in tokens],
            log_probs=[torch.tensor(x, dtype=torch.float32) for x in lps],
            loss_masks=[torch.tensor(m, dtype=torch.int8) for m in mask],
            turns=turns, truncated=[not f for f in finished], calls=calls)
