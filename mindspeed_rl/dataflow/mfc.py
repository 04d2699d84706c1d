"""Model function calls (MFCs): one stage of an RL algorithm, written as data.

An MFC says *which model* (role) is called, *how* (generate, inference, train_step, compute), which
dock columns it reads and which it writes, and where it runs. An algorithm is a list of MFCs;
`mindspeed_rl.dataflow.graph.build_graph` turns the list into the graph the trainer runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class InterfaceType(str, Enum):
    """How an MFC calls its model."""

    GENERATE = "generate"      # rollout engine: sample responses
    INFERENCE = "inference"    # forward pass only (log-probs, values, reward model scores)
    TRAIN_STEP = "train_step"  # forward + backward + optimizer steps: changes the model's weights
    COMPUTE = "compute"        # plain tensor math or Python (rule rewards, advantages), no weights

    def __str__(self) -> str:
        return self.value


_ALLOWED_INTERFACES = ", ".join(repr(t.value) for t in InterfaceType)


def _normalize_interface(mfc_name: str, value) -> InterfaceType:
    if isinstance(value, InterfaceType):
        return value
    if isinstance(value, str):
        try:
            return InterfaceType(value.strip().lower())
        except ValueError:
            pass
    raise ValueError(f"MFC {mfc_name!r}: interface_type={value!r} is not a known interface type; "
                     f"use one of {_ALLOWED_INTERFACES}")


def _normalize_keys(mfc_name: str, field: str, value) -> tuple[str, ...]:
    if isinstance(value, str):
        raise ValueError(f"MFC {mfc_name!r}: {field}={value!r} is a single string, not a sequence of "
                         f"key names; write {field}=({value!r},)")
    try:
        keys = tuple(value)
    except TypeError:
        raise ValueError(f"MFC {mfc_name!r}: {field}={value!r} is not a sequence of key names; "
                         f"write e.g. {field}=('prompts', 'responses')") from None
    for key in keys:
        if not isinstance(key, str) or not key.strip():
            raise ValueError(f"MFC {mfc_name!r}: {field} contains {key!r}; every key must be a "
                             f"non-empty column name string")
    seen, dups = set(), []
    for key in keys:
        if key in seen and key not in dups:
            dups.append(key)
        seen.add(key)
    if dups:
        raise ValueError(f"MFC {mfc_name!r}: {field}={keys!r} lists {', '.join(map(repr, dups))} more "
                         f"than once; list each key once")
    return keys


@dataclass(frozen=True)
class MFCDef:
    """One model function call: a stage of the algorithm's dataflow graph.

    The first five fields alone make a valid MFC; the rest say where and how it runs.

    name:           unique stage name; also the dock consumer name (e.g. ``"actor_log_prob"``).
    model_name:     the role whose model is called (``"actor"``, ``"ref"``, ``"critic"``, ``"reward"``...).
                    MFCs that share a model_name share weights.
    interface_type: an `InterfaceType` or its string (``"generate"``, ``"inference"``,
                    ``"train_step"``, ``"compute"``).
    input_keys:     dock columns the MFC reads (lists accepted, stored as tuples).
    output_keys:    dock columns the MFC writes; may be empty (e.g. a train step).
    worker_group:   name of the worker group that runs the MFC; None means its own group named after
                    the MFC (see `worker_group_name`). MFCs naming the same group are colocated.
                    The trainer's config may override it.
    dp_size:        data-parallel workers in the group.
    get_n_samples:  True when the MFC must receive whole prompt groups (all n samples of a prompt),
                    e.g. GRPO's group-normalized advantage.
    micro_batch_size: rows per pull from the dock; None means the trainer's default.
    fn:             the compute function that runs the MFC, by name (``mindspeed_rl.workers.compute.FUNCTIONS``:
                    ``"generate"``, ``"log_probs"``, ``"values"``, ``"rule_reward"``, ``"gae_advantage"``,
                    ``"policy_train"``, ...). None means the interface type's default (generate: ``generate``,
                    inference: ``log_probs``, train_step: ``policy_train``); a compute MFC must name one.
    input_key_remap:  dock column -> the function's argument name, for a column named otherwise than the
                    function expects (ReaLHF's name), e.g. ``{"greedy_responses": "responses"}``.
    output_key_remap: the function's output name -> dock column, e.g. ``{"log_prob": "ref_log_prob"}``.
    fn_args:        arguments of the function's implementation (workers/steps/) over those it takes from the
                    config, e.g. ``{"temperature": 0.0}`` for one generate MFC (ReaLHF's interface_impl args).

    Why name functions instead of dispatching on the role: the same function serves several MFCs
    (``log_probs`` gives both ``old_log_prob`` and ``ref_log_prob``; ``rule_reward`` scores sampled
    and greedy responses), so a new algorithm is a new list of MFCs and no new worker code.
    """

    name: str
    model_name: str
    interface_type: InterfaceType
    input_keys: tuple[str, ...]
    output_keys: tuple[str, ...]
    worker_group: str | None = None
    dp_size: int = 1
    get_n_samples: bool = False
    micro_batch_size: int | None = None
    fn: str | None = None
    input_key_remap: dict = field(default_factory=dict, hash=False)
    output_key_remap: dict = field(default_factory=dict, hash=False)
    fn_args: dict = field(default_factory=dict, hash=False)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"MFC of model {self.model_name!r}: name={self.name!r} is empty; give every "
                             f"MFC a unique non-empty name such as 'actor_rollout'")
        name = self.name
        if not isinstance(self.model_name, str) or not self.model_name.strip():
            raise ValueError(f"MFC {name!r}: model_name={self.model_name!r} is empty; name the role whose "
                             f"model it calls, e.g. 'actor', 'ref', 'reward'")
        object.__setattr__(self, "interface_type", _normalize_interface(name, self.interface_type))
        inputs = _normalize_keys(name, "input_keys", self.input_keys)
        outputs = _normalize_keys(name, "output_keys", self.output_keys)
        both = [key for key in inputs if key in outputs]
        if both:
            raise ValueError(f"MFC {name!r}: key(s) {', '.join(map(repr, both))} are in both input_keys "
                             f"and output_keys; an MFC may not overwrite a column it reads, write the "
                             f"result to a new key (e.g. {both[0] + '_new'!r})")
        object.__setattr__(self, "input_keys", inputs)
        object.__setattr__(self, "output_keys", outputs)
        if self.worker_group is not None and (not isinstance(self.worker_group, str)
                                              or not self.worker_group.strip()):
            raise ValueError(f"MFC {name!r}: worker_group={self.worker_group!r} is empty; give a group "
                             f"name or None for a group of its own")
        if isinstance(self.dp_size, bool) or not isinstance(self.dp_size, int) or self.dp_size < 1:
            raise ValueError(f"MFC {name!r}: dp_size={self.dp_size!r} must be an integer >= 1; "
                             f"use 1 for a single worker")
        if not isinstance(self.get_n_samples, bool):
            raise ValueError(f"MFC {name!r}: get_n_samples={self.get_n_samples!r} must be True or False")
        mbs = self.micro_batch_size
        if mbs is not None and (isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1):
            raise ValueError(f"MFC {name!r}: micro_batch_size={mbs!r} must be an integer >= 1, or None "
                             f"for the trainer's default")

        if self.fn is not None and (not isinstance(self.fn, str) or not self.fn.strip()):
            raise ValueError(f"MFC {name!r}: fn={self.fn!r} is empty; name a compute function such as "
                             f"'rule_reward', or None for the interface type's default")
        for which, remap, keys in (("input_key_remap", self.input_key_remap, inputs),
                                   ("output_key_remap", self.output_key_remap, outputs)):
            if not isinstance(remap, dict):
                raise ValueError(f"MFC {name!r}: {which}={remap!r} must be a dict of names")
            bad = [k for k, v in remap.items() if not (isinstance(k, str) and isinstance(v, str) and k and v)]
            if bad:
                raise ValueError(f"MFC {name!r}: {which} has non-string or empty names {bad!r}")
            column_side = remap.keys() if which == "input_key_remap" else remap.values()
            stray = [c for c in column_side if c not in keys]
            if stray:
                side = "input_keys" if which == "input_key_remap" else "output_keys"
                raise ValueError(f"MFC {name!r}: {which} names column(s) {', '.join(map(repr, stray))} that are "
                                 f"not in its {side} {keys!r}; remap only columns the MFC "
                                 f"{'reads' if side == 'input_keys' else 'writes'}")
        if not isinstance(self.fn_args, dict) or not all(isinstance(k, str) and k for k in self.fn_args):
            raise ValueError(f"MFC {name!r}: fn_args={self.fn_args!r} must be a dict of argument name -> value")
        object.__setattr__(self, "fn_args", dict(self.fn_args))
        object.__setattr__(self, "input_key_remap", dict(self.input_key_remap))
        object.__setattr__(self, "output_key_remap", dict(self.output_key_remap))

    def arg_name(self, column: str) -> str:
        """The compute function's name for the dock column `column` this MFC reads."""
        return self.input_key_remap.get(column, column)

    def column_of(self, output: str) -> str:
        """The dock column the compute function's output `output` goes to."""
        return self.output_key_remap.get(output, output)

    @property
    def is_trainable(self) -> bool:
        """True for a train_step MFC: it changes its model's weights."""
        return self.interface_type is InterfaceType.TRAIN_STEP

    @property
    def worker_group_name(self) -> str:
        """The worker group that runs this MFC: `worker_group`, or the MFC's own name."""
        return self.worker_group if self.worker_group is not None else self.name
