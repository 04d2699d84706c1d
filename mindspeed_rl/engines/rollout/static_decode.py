"""The hf engine's decode loop in fixed shapes, so that a CUDA graph can replay each step.

An eager decode step of a 0.5B model is launch-bound on a GPU (hundreds of small kernels, each queued
by Python), and a `DynamicCache` re-concatenates every layer's K/V per token. Here everything a step
touches is allocated once per (rows, cache length, sampling settings): per-layer K/V buffers
[rows, kv_heads, prompt + max new, head_dim], the full-width 4D additive mask (a column opened per
token, in place), the fed tokens, positions, cache column and token index as device tensors, and the
responses' per-row state. One step (forward, sampler, stop bookkeeping) is then a function of fixed
shapes per (batch bucket, width bucket), captured once per pair on CUDA (`torch.cuda.CUDAGraph`) and
replayed; on other devices it runs eagerly (what the CPU tests check against the eager path, token for
token).

A step attends over the cache's leading columns up to its width bucket (multiples of `WIDTH_STEP`
columns: the first that holds the fed token's column), not over the whole buffer: a decode at column 300
of a 3,072-column buffer reads 512 columns, so its work grows with the sequence as the eager loop's does.
Columns past what a row has written are masked. Grouped-query attention reads each K/V head once per
group (gqa_decode.py), not once per query head.

Finished rows stay in the batch as padding (their tokens are discarded, as in the eager loop) until the
running rows fit a smaller bucket (powers of two below the batch); the loop then selects the slots of
the running rows, without a host sync (a stable sort puts running slots first), into the buffers'
leading rows, which the smaller bucket's graph reads. Who is still running is learnt from a count the
step leaves on the device, copied every `check_every` tokens into pinned host memory without blocking
and read one check later: the host never waits for the step it just queued.

A row's tokens do not depend on the bucket it runs in (each row reads only its own K/V, mask row and
uniforms), which is also what the eager loop's row dropping relies on.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from ..base import Rollout, SamplingParams
from .sampling import sample_next


WIDTH_STEP = 256   # columns between width buckets


def widths(length: int, step: int = WIDTH_STEP) -> list[int]:
    """The cache widths a decode attends over, ascending: multiples of `step` below `length`, then `length`."""
    return sorted({min(length, w) for w in range(step, length + step, step)})


def buckets(rows: int) -> list[int]:
    """The batch sizes a decode runs at: the whole batch, then the powers of two below it, descending."""
    out = [rows]
    b = 1 << ((rows - 1).bit_length() - 1) if rows > 1 else 0   # the largest power of two below `rows`
    while b >= 1:
        out.append(b)
        b //= 2
    return out


class StaticKV:
    """A KV cache transformers' attention writes through `update(key, value, layer_idx)`: the new token's
    K/V go into column `column` (a device tensor, so a replayed graph writes where the step says), and the
    whole buffers come back, masked beyond what each row has seen by the engine's 4D mask. Only the
    attention layers call it: the engine always passes `position_ids` and a 4D mask, so transformers
    asks it nothing else."""

    is_compileable = True
    is_sliding = [False]

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], column: torch.Tensor):
        self.keys, self.values, self.column = keys, values, column

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.column, key_states)
        v.index_copy_(2, self.column, value_states)
        return k, v


class HostFlag:
    """The running-row count on the host without waiting for the device. On CUDA each `exchange` starts a
    non-blocking copy into pinned memory and returns the count copied at the previous exchange (its event
    long passed: `check_every` steps ago), None at the first; elsewhere the count itself (a plain read)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.host = torch.zeros(2, dtype=torch.long, pin_memory=True)
            self.events = [torch.cuda.Event(), torch.cuda.Event()]
        self.turn = 0
        self.posted = [False, False]

    def reset(self) -> None:
        self.posted = [False, False]

    def exchange(self, count: torch.Tensor) -> int | None:
        if not self.cuda:
            return int(count)
        i, j = self.turn, 1 - self.turn
        self.host[i:i + 1].copy_(count, non_blocking=True)
        self.events[i].record()
        self.posted[i] = True
        self.turn = j
        if not self.posted[j]:
            return None
        self.events[j].synchronize()
        self.posted[j] = False
        return int(self.host[j])


def sampling_key(params: SamplingParams) -> tuple:
    """What a captured step bakes in: the sampler's branches and constants and the stop ids it compares with
    (a tensor captured by the graph)."""
    return (bool(params.greedy), float(params.temperature), float(params.top_p), int(params.top_k),
            tuple(sorted(int(t) for t in params.stop_token_ids)), int(params.max_new_tokens))


@dataclass
class _Bucket:
    rows: int
    width: int
    cache: StaticKV
    graph: object | None = None   # torch.cuda.CUDAGraph once captured


class StaticDecoder:
    """One set of fixed buffers for `rows` x `length` (prompt + new tokens) and one sampling setting:
    `run` decodes a batch of at most `length - max_new_tokens` prompt tokens in it, reusing the buffers
    and captured graphs across calls (a rollout's calls share their shapes: the rows per call and the
    run's longest prompt + response)."""

    def __init__(self, model: torch.nn.Module, rows: int, length: int, params: SamplingParams, pad_token_id: int,
                 device: torch.device, check_every: int, capture: bool, width_step: int = WIDTH_STEP):
        cfg = model.config
        layers = cfg.num_hidden_layers
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(model.parameters()).dtype
        n = params.max_new_tokens
        self.model, self.params, self.pad, self.device = model, params, int(pad_token_id), device
        self.rows, self.length, self.n, self.dtype = rows, length, n, dtype
        self.check_every, self.capture = check_every, capture
        self.keys = [torch.zeros((rows, kv_heads, length, head_dim), dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.mask = torch.zeros((rows, 1, 1, length), dtype=dtype, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)   # the fed token's cache column
        self.t = torch.zeros(1, dtype=torch.long, device=device)        # the index of the token a step samples
        self.slot_rows = torch.zeros(rows, dtype=torch.long, device=device)  # each slot's original row
        self.fed = torch.zeros(rows, dtype=torch.long, device=device)
        self.pos = torch.zeros((rows, 1), dtype=torch.long, device=device)     # the fed token's position
        self.draws = torch.zeros((rows, n), dtype=torch.float32, device=device)
        self.tokens = torch.zeros((rows, n), dtype=torch.long, device=device)
        self.log_probs = torch.zeros((rows, n), dtype=torch.float32, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.running = torch.zeros((), dtype=torch.long, device=device)
        self.stop = torch.tensor(sorted(params.stop_token_ids), dtype=torch.long, device=device)
        self.flag = HostFlag(device)
        self.widths = widths(length, width_step)
        self.buckets = {(b, w): _Bucket(b, w, StaticKV([k[:b, :, :w] for k in self.keys],
                                                       [v[:b, :, :w] for v in self.values], self.column))
                        for b in buckets(rows) for w in self.widths}
        self.moves: list[int] = []   # the batch buckets the last `run` moved down to (what tests assert)
        self.widened: list[int] = []   # the width buckets it moved up to
        self.pool = None     # the graphs' one memory pool, made by the first capture
        self.stream = None   # this decoder's capture stream: its graphs share a pool, so they share a stream

    # ------------------------------------------------------------------------------------------ the step
    def _record(self, b: int, tokens: torch.Tensor, log_probs: torch.Tensor) -> None:
        """`ResponseBuilder.add` at a device-side token index: ended rows get padding, a stop token ends a
        row, and the running count is left on the device for the host's next check."""
        rows = self.slot_rows[:b]
        t = self.t.expand(b)
        ended = self.finished.index_select(0, rows)
        tokens = torch.where(ended, torch.full_like(tokens, self.pad), tokens)
        self.tokens.index_put_((rows, t), tokens)
        self.log_probs.index_put_((rows, t), log_probs.float())
        if self.stop.numel():
            hit = torch.isin(tokens, self.stop) & ~ended
            self.lengths.index_put_((rows,), torch.where(hit, t + 1, self.lengths.index_select(0, rows)))
            done = ended | hit
            self.finished.index_put_((rows,), done)
            self.running.copy_((~done).sum())
        self.fed[:b].copy_(tokens)
        self.t.add_(1)

    def _step(self, b: int, w: int) -> None:
        """One token for the `b` leading slots over the cache's first `w` columns: open the fed token's mask
        column, forward it into the static cache, sample, record. Fixed shapes and no host reads: what a CUDA
        graph captures."""
        self.mask[:b].index_fill_(-1, self.column, 0)
        out = self.model(input_ids=self.fed[:b, None], attention_mask=self.mask[:b, :, :, :w],
                         position_ids=self.pos[:b], past_key_values=self.buckets[(b, w)].cache, use_cache=True)
        uniforms = self.draws[:b].index_select(1, self.t).squeeze(1)
        self._record(b, *sample_next(out.logits[:, -1, :], self.params, uniforms))
        self.pos[:b].add_(1)
        self.column.add_(1)

    def _run_step(self, b: int, w: int) -> None:
        bucket = self.buckets[(b, w)]
        if bucket.graph is not None:
            bucket.graph.replay()
        elif not self.capture:
            self._step(b, w)
        else:
            bucket.graph = self._capture(b, w)

    def _capture(self, b: int, w: int):
        """Runs this step eagerly, then records it (device/capture.py: one capture at a time per process)."""
        from ...device.capture import capture_graph
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=self.device)
        # one pool (and one stream) for every graph of this decoder
        graph, self.pool = capture_graph(lambda: self._step(b, w), self.pool, self.stream)
        return graph

    def _move(self, b: int, to: int, w: int) -> None:
        """Moves the decode from bucket `b` to the smaller bucket `to`: the running slots first (a stable
        sort keeps their order; no host sync), gathered into the leading `to` rows of every per-slot buffer
        (of the K/V, the `w` columns written so far)."""
        keep = torch.argsort(self.finished.index_select(0, self.slot_rows[:b]).to(torch.uint8), stable=True)[:to]
        for buf in (self.slot_rows, self.fed, self.pos, self.draws, self.mask):
            buf[:to].copy_(buf[:b].index_select(0, keep))
        for buf in (*self.keys, *self.values):
            buf[:to, :, :w].copy_(buf[:b, :, :w].index_select(0, keep))
        self.moves.append(to)

    # ------------------------------------------------------------------------------------------- a batch
    def run(self, prefill: Callable[[], tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]],
            attn: torch.Tensor, last_pos: torch.Tensor, draws: torch.Tensor,
            step_guard: Callable[[], ContextManager] = contextlib.nullcontext) -> Rollout:
        """Decodes a left-padded batch: `prefill()` runs the prompt's forward (the eager path's own) and
        returns the last position's logits and each layer's (keys, values); `attn` is the prompts' 2D mask,
        `last_pos` their last positions [B, 1], `draws` the rows' uniforms [B, max_new_tokens]. Each decode
        step runs inside `step_guard()` (the engine's lock that a weight update mid-call waits on)."""
        B, P = attn.shape
        if B != self.rows or P + self.n > self.length:
            raise ValueError(f"static decode: {B} rows x {P} prompt tokens do not fit its {self.rows} x "
                             f"{self.length - self.n} buffers")
        logits, kv = prefill()
        for k, v, (pk, pv) in zip(self.keys, self.values, kv):
            k[:, :, :P].copy_(pk)
            v[:, :, :P].copy_(pv)
        self.mask.fill_(torch.finfo(self.dtype).min)
        self.mask[:, 0, 0, :P].masked_fill_(attn.bool(), 0)
        self.slot_rows.copy_(torch.arange(B, device=self.device))
        self.pos.copy_(last_pos + 1)   # the first fed token's position
        self.draws.copy_(draws)
        self.tokens.fill_(self.pad)
        self.log_probs.zero_()
        self.lengths.fill_(self.n)
        self.finished.zero_()
        self.running.fill_(B)
        self.column.fill_(P)
        self.t.zero_()
        self.flag.reset()
        self.moves, self.widened = [], []
        self._record(B, *sample_next(logits, self.params, draws[:, 0]))
        order = buckets(self.rows)
        b, t = B, 1
        w = min(x for x in self.widths if x > P)
        while t < self.n:
            if P + t > w:   # this step writes column P + t - 1
                w = min(x for x in self.widths if x >= P + t)
                self.widened.append(w)
            if self.stop.numel() and t % self.check_every == 0:
                running = self.flag.exchange(self.running)
                if running == 0:
                    break
                if running is not None:
                    to = min((s for s in order if s >= running), default=b)
                    if to < b:
                        self._move(b, to, w)
                        b = to
            with step_guard():
                self._run_step(b, w)
            t += 1
        resp, lp = self.tokens.cpu(), self.log_probs.cpu()
        n = self.lengths.cpu().numpy().tolist()
        return Rollout([resp[i, :k].clone() for i, k in enumerate(n)], [lp[i, :k].clone() for i, k in enumerate(n)])


class StaticDecoders:
    """The engine's decoders by shape and sampling setting. `generate` may run in several threads at once
    (the weights are only read), so a decoder is taken out while it runs and put back after; a second
    concurrent call of the same shape builds its own."""

    KEEP = 2   # shapes kept: a run's training and validation sampling

    def __init__(self):
        self._free: dict[tuple, list[StaticDecoder]] = {}
        self._lock = threading.Lock()

    def take(self, key: tuple, build: Callable[[], StaticDecoder]) -> StaticDecoder:
        with self._lock:
            free = self._free.pop(key, [])
            decoder = free.pop() if free else None
            self._free[key] = free   # the most recently used key last
            while len(self._free) > self.KEEP:   # the least recently used shape's buffers and graphs go
                del self._free[next(iter(self._free))]
        return decoder or build()

    def give(self, key: tuple, decoder: StaticDecoder) -> None:
        with self._lock:
            self._free.setdefault(key, []).append(decoder)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
