"""Generation on a (pp, dp, tp) device mesh: the HF rollout backend's model split by tensor and
pipeline parallelism, for placements that give generation tp or pp > 1 (ReaLHF's "actor
generation DP=4 PP=2"; placement.mode: mesh with `generate_config.backend: hf`, whose registry
entry has `split="mesh"`).

The model is the mesh train backend's (`MeshTrainEngine`, built without an optimizer and with
`dp_shard=false`, so each data-parallel replica holds its own copy and replicas generate
independently: one replica may take more micro-batches from the dock than another, or stop earlier).
Each new token is one forward of the whole sequence through the replica's stages (a
`torch.distributed.pipelining` GPipe `eval` over up to pp chunks of the rows, so the stages work on
different chunks at once; TP layers as in training). The last stage samples; its TP rank 0
broadcasts the sampled tokens and their log-probs to the replica, so every rank returns the same
`Rollout` and knows when every row has stopped.

Sampling is the HF backend's (`sampling.sample_next`): row i draws with the uniforms of
`seeds[i]`, so a row gets the same tokens as the unsplit HF engine gives it (the logits agree to
float rounding; measured equal tokens and log-probs within 1e-5 on the tiny model, tests/engines/
test_mesh_rollout.py). As there, rows that have ended leave the batch at the `ResponseBuilder`'s
checks; every rank of the replica holds the same builder state, so they drop the same rows.

There is no KV cache across stages: step t recomputes the prompt and the t tokens before it. For
the tiny models and short responses this costs little; for long responses on GPUs use vLLM (its
tensor parallelism, `split="engine"`).

Calling contract: every rank of a replica calls `generate` with the same prompts and seeds (the
worker broadcasts the reader's micro-batch to its replica first), and the ranks of different
replicas need not call it together.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..base import NamedTensors, Rollout, RolloutEngine, RolloutSpec, SamplingParams, TrainSpec
from ..batching import left_pad, positions
from .hf_rollout import ResponseBuilder
from ..train.mesh_train import MeshTrainEngine
from .sampling import row_uniforms, sample_next

OPTIONS = {"tp", "pp", "dp"}


class MeshRolloutEngine(RolloutEngine):
    concurrent_generate = False  # each generate is collective over the replica: one at a time, in order

    def __init__(self, model: MeshTrainEngine):
        self.model = model
        self.device = model.device
        self.pad_token_id = model.pad_token_id
        self.weight_version = 0

    @classmethod
    def build(cls, spec: RolloutSpec) -> "MeshRolloutEngine":
        unknown = set(spec.options) - OPTIONS
        if unknown:
            raise ValueError(f"mesh rollout options {sorted(unknown)} unknown; known: {sorted(OPTIONS)}")
        options = {k: int(spec.options.get(k, 1)) for k in ("tp", "pp", "dp")}
        # temperature 1: the stages return raw logits and sample_next applies the request's temperature
        train = TrainSpec(model_path=spec.model_path, model_kind="causal_lm", dtype=spec.dtype, device=spec.device,
                          pad_token_id=spec.pad_token_id, temperature=1.0, optim=None, seed=spec.seed,
                          options={**options, "dp_shard": False, "pp_schedule": "gpipe"}, role=spec.role)
        return cls(MeshTrainEngine.build(train))

    # ------------------------------------------------------------------ generation
    def _last_logits(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor | None:
        """Logits at the last position of every row, on the last stage (None on the others)."""
        m = self.model
        pos = positions(attn)
        width = ids.shape[1]
        m.stage.response_slice = (width, 1)
        if m.pp == 1:
            return m.stage(ids, attn, pos)[:, -1]
        batch = ids.shape[0]
        n_mb = min(m.pp, batch)
        rows = -(-batch // n_mb)
        extra = n_mb * rows - batch
        if extra:  # equal chunks: copies of row 0, cut off below
            ids = torch.cat([ids, ids[:1].expand(extra, -1)])
            attn = torch.cat([attn, attn[:1].expand(extra, -1)])
            pos = torch.cat([pos, pos[:1].expand(extra, -1)])
        sched = m._pipeline(n_mb, rows, width, 1, has_backward=False)
        out = sched.eval(*((ids,) if m.is_first else ()), attention_mask=attn, position_ids=pos)
        return out[:batch, -1] if m.is_last else None

    @torch.no_grad()
    def generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams, seeds: Sequence[int]) -> Rollout:
        if len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(seeds)} seeds; one seed per row")
        m = self.model
        ids, attn = left_pad(prompts, self.pad_token_id)
        ids, attn = ids.to(self.device), attn.to(self.device)
        draws = row_uniforms(seeds, params.max_new_tokens, self.device)
        responses = ResponseBuilder(ids.shape[0], params, self.pad_token_id, self.device)
        while True:
            logits = self._last_logits(ids, attn)
            # tokens (exact in float64) and their log-probs travel together from the last stage's TP rank 0
            box = torch.empty(2, ids.shape[0], dtype=torch.float64, device=self.device)
            if logits is not None:
                nxt, logp = sample_next(logits, params, draws[:, responses.t])
                box[0].copy_(nxt)
                box[1].copy_(logp)
            if m.replica_group is not None and m.pp > 1:
                dist.broadcast(box, src=m.writer_rank, group=m.replica_group)
            nxt = responses.add(box[0].long(), box[1].float())
            keep = responses.compaction()
            if responses.complete:
                return responses.rollout()
            if keep is not None:  # drop the rows that have ended, on every rank alike
                nxt, ids, attn, draws = nxt[keep], ids[keep], attn[keep], draws[keep]
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Every rank is given the full tensors and keeps its stage's (and TP rank's) part."""
        self.model.update_weights(named_tensors, version)
        self.weight_version = int(version)

    @property
    def is_dock_reader(self) -> bool:
        return self.model.is_dock_reader

    @property
    def is_dock_writer(self) -> bool:
        return self.model.is_dock_writer

    @property
    def replica_group(self):
        return self.model.replica_group

    @property
    def reader_rank(self) -> int:
        return self.model.reader_rank

    @property
    def dp_rank(self) -> int:
        return self.model.dp_rank

    @property
    def dp_size(self) -> int:
        return self.model.dp_size

    @property
    def shares_batches(self) -> bool:
        """Every rank of a replica samples the reader's rows with their seeds: it needs the micro-batch."""
        return self.replica_group is not None

    @property
    def writer_rank(self) -> int:
        return self.model.writer_rank

    def close(self) -> None:
        self.model.close()
