"""Every YAML section as a dataclass with defaults: the one place that says what a key means.

Section names follow MindSpeed-RL (`actor_config`, `generate_config`, `rl_config`, ...); keys
that scripts rely on (`trainer.total_steps`, `rl_config.blocking`, ...) keep their names.
`docs/configs.md` documents every key; `tests/config` checks that the two agree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


_PROMPTS = ("counted in prompts (verl's ppo_mini_batch_size: x rl_config.n_samples_per_prompt rows inside, so it "
            "stays valid when n changes); set {new}={converted}")
_ROWS = "the same rows per device (verl's *_micro_batch_size_per_gpu); set {new}={value}"

# Old key -> (new key, how its value converts). The loader refuses an old key with this message
# instead of "unknown key", so a config written for the old names says exactly what to change.
RENAMED_KEYS: dict[str, tuple[str, str]] = {
    "actor_config.mini_batch_size": ("actor_config.ppo_mini_batch_size", _PROMPTS),
    "actor_config.micro_batch_size": ("actor_config.ppo_micro_batch_size_per_device", _ROWS),
    "actor_config.log_prob_micro_batch_size": ("actor_config.log_prob_micro_batch_size_per_device", _ROWS),
    "ref_config.micro_batch_size": ("ref_config.log_prob_micro_batch_size_per_device", _ROWS),
    "critic_config.mini_batch_size": ("critic_config.ppo_mini_batch_size", _PROMPTS),
    "critic_config.micro_batch_size": ("critic_config.ppo_micro_batch_size_per_device", _ROWS),
    "critic_config.infer_micro_batch_size": ("critic_config.forward_micro_batch_size_per_device", _ROWS),
    "generate_config.micro_batch_size": ("generate_config.micro_batch_size_per_device",
                                         _ROWS + " (now rounded down to whole prompt groups instead of refused)"),
}


def renamed_key_message(old: str, value, n_samples_per_prompt: int = 8) -> str | None:
    """The refusal of old key `old` set to `value` (its new value worked out for n), or None if not renamed."""
    if old not in RENAMED_KEYS:
        return None
    new, how = RENAMED_KEYS[old]
    n = n_samples_per_prompt if isinstance(n_samples_per_prompt, int) and n_samples_per_prompt > 0 else 8
    if value is None:
        converted = "null"
    elif isinstance(value, int) and value % n == 0:
        converted = f"{value // n} ({value} rows / rl_config.n_samples_per_prompt={n})"
    else:
        converted = (f"<old value / n_samples_per_prompt> ({value} rows are not whole groups of {n}: pick a number "
                     f"of prompts that divides rl_config.prompts_per_step)")
    shown = "null" if value is None else value
    return f"{old}={shown}: renamed: it is now {new}, " + how.format(new=new, value=shown, converted=converted)


def renamed_keys_error(data) -> str | None:
    """Every old key name in a raw config mapping, each with what it became; None when there is none."""
    rl = data.get("rl_config") if isinstance(data.get("rl_config"), dict) else {}
    n = rl.get("n_samples_per_prompt", RLConfig.n_samples_per_prompt)
    found = []
    for old in RENAMED_KEYS:
        section, key = old.split(".")
        if isinstance(data.get(section), dict) and key in data[section]:
            found.append(renamed_key_message(old, data[section][key], n))
    return "; ".join(found) + " (see docs/configs.md)" if found else None


@dataclass
class TrainerConfig:
    total_steps: int = 200               # RL steps (one batch of prompts each)
    output_dir: str = "outputs/grpo_tiny"  # metrics.jsonl, checkpoints/, curve.png go here
    seed: int = 1                        # seeds data order, sampling and model init
    save_interval: int = 0               # checkpoint every N steps (0: only at the end when > 0 steps ran)
    keep_checkpoints: int = 3            # newest complete checkpoints kept, older ones deleted; 0: keep all
    resume: bool = False                 # continue from the newest checkpoint in output_dir
    overwrite: bool = False              # a fresh run over a previous run's results deletes them (else refused)
    dry_run: bool = False                # check, print graph and placement plan, write plan.json, start nothing
    plugins: list = field(default_factory=list)  # modules imported (driver and every worker) before any engine is
                                         # built: they register backends (engines.register_*_backend)
    logger: list = field(default_factory=lambda: ["console", "jsonl"])  # console, jsonl, tensorboard, wandb, mlflow
    project_name: str = "mindspeed_rl"   # wandb's project, mlflow's experiment
    experiment_name: Optional[str] = None  # wandb's and mlflow's run name; null: output_dir's last part
    tags: list = field(default_factory=list)  # wandb's run tags, mlflow's tags (strings)
    save_hf: str = "final"               # the policy as a Hugging Face checkpoint in output_dir/hf: final, every_save
                                         # (also at each checkpoint), never
    progress: bool = True                # per-step progress bar with per-stage consumption
    stage_timeout_s: float = 120.0       # a stage waiting longer than this for its inputs fails the run
    plot: bool = True                    # write curve.png (reward and loss per step) at the end
    dashboard: bool = True               # serve the live dashboard on 127.0.0.1 while training
    dashboard_port: int = 0              # its port; 0: any free port (the URL is printed at start)
    report: bool = True                  # write report.html (+ dashboard.json) in output_dir, also on a crash
    # stage -> seconds per row: stages sleep instead of computing, no models (engines/simulate/); {}: off
    simulate_cost_s_per_row: dict = field(default_factory=dict)
    # the simulate backend's generation as a serving engine: this many rows decode at once, each for cost x slots x
    # a mean-1 lognormal factor of spread simulate_generate_sigma (long-tailed lengths); 0: rows one after another
    simulate_generate_slots: int = 0
    simulate_generate_sigma: float = 0.0
    eval_interval: int = 0               # reward modeling: held-out accuracy and margin every N steps (0: at the end)
    val_interval: int = 0                # validation on data.val_dataset every N steps and after the last (0: off)
    val_before_train: bool = False       # also validate the starting weights before the first step
    log_samples: int = 4                 # training rows per step written as text to <output_dir>/samples/ (each
                                         # validation writes all of its rows); 0: none from training


@dataclass
class LoraConfig:
    """actor_config.lora: low-rank adapters through peft (engines/train/lora.py); rank 0 is off."""
    rank: int = 0                        # adapter rank r; 0: no LoRA, the whole model trains
    alpha: float = 16.0                  # scaling alpha / rank of the adapter's output
    target_modules: list = field(default_factory=lambda: ["all-linear"])  # module names (q_proj, ...) or
                                         # all-linear: every linear layer but the LM head (peft's name)
    dropout: float = 0.0                 # dropout on the adapter's input
    modules_to_save: list = field(default_factory=list)  # modules trained whole beside the adapters, as a copy
                                         # (peft's modules_to_save; a name matches the end of a module's name:
                                         # norm takes every RMSNorm); the base keeps its own
    lr: Optional[float] = None           # AdamW's learning rate of the adapters; null: actor_config.lr
    modules_to_save_lr: Optional[float] = None  # AdamW's learning rate of the modules_to_save copies;
                                         # null: the adapters' lr


@dataclass
class OffloadConfig:
    """Where a train engine's state waits between its stages when the device is shared (engines/train/offload.py)."""
    params: bool = False                 # parameters (and gradients) to pinned CPU memory after the train stage
    optimizer: bool = False              # AdamW's moments to pinned CPU memory after the train stage
    fsdp_cpu_offload: bool = False       # fsdp only: FSDP2's own CPUOffloadPolicy (parameters live on the CPU,
                                         # the optimizer steps there)


@dataclass
class ActorConfig:
    model_path: str = "builtin:tiny-qwen2"  # local HF checkpoint dir, or builtin:tiny-qwen2
    backend: str = "torch"               # torch (DDP), fsdp (FSDP2), megatron; also the reference's and critic's
    backend_options: dict = field(default_factory=dict)  # the train backend's options (its dataclass checks them):
                                         # fsdp: reshard_after_forward; megatron: layer_spec, ... (docs/engines.md)
    dtype: str = "float32"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    # sizes (verl's convention): *_per_device count rows on one DP rank, ppo_mini_batch_size counts prompts
    ppo_mini_batch_size: Optional[int] = 4  # prompts per optimizer step (x n_samples_per_prompt rows); null: 1 step
    ppo_micro_batch_size_per_device: int = 32  # rows per forward/backward; rounded to divide the mini-batch
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0            # dual-clip bound for negative advantages
    loss_agg_mode: str = "token-mean"    # one of vocab.AGG_MODES
    use_kl_loss: bool = True             # GRPO's KL to the reference in the loss
    kl_loss_type: str = "k3"             # one of vocab.KL_KINDS (k3: verl's low_var_kl)
    kl_loss_coef: float = 0.001
    kl_ctrl: str = "fixed"               # vocab.KL_CONTROLLER_KINDS: fixed or adaptive, on top of kl_loss_coef
    kl_target: float = 0.1               # adaptive only
    kl_horizon: int = 10000              # adaptive only
    entropy_coeff: float = 0.0
    log_prob_micro_batch_size_per_device: int = 64  # rows per get and forward of old log-probs
    max_tokens_per_micro_batch: Optional[int] = None  # rows x padded length per forward (length-sorted split, no
                                         # compute on other rows' padding); null: a micro-batch is one forward
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in the backward instead of
                                         # keeping them (transformers' gradient_checkpointing_enable; megatron:
                                         # full recompute)
    lora: LoraConfig = field(default_factory=LoraConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    model_config: Optional[str] = None   # the memory plan's model dimensions when the weights are not on this
                                         # machine: a config.json path or a shipped architecture (qwen2.5-7b, ...);
                                         # null: model_path's config.json, else the name of model_path
    off_policy_correction: Optional[str] = None  # none, tis (verl's truncated IS), decoupled (AReaL's decoupled
                                         # PPO); null: tis with rl_config.partial_rollout (its rows mix versions), else none
    tis_cap: float = 2.0                 # cap of the behaviour importance weight (tis, decoupled)
    recompute_log_prob: Optional[bool] = None  # the old log-probs by a forward before the update; null: only when
                                         # a step's rows feed more than one optimizer step or older weights made
                                         # them (else the update's own detached log-probs are the old ones, as TRL)


@dataclass
class RefConfig:
    model_path: Optional[str] = None     # null: the actor's initial checkpoint
    log_prob_micro_batch_size_per_device: int = 64  # rows per get and forward of reference log-probs
    offload: bool = False                # the reference's weights wait in CPU memory between its passes


@dataclass
class CriticConfig:
    """The value model of algorithms with a critic (PPO); unused by GRPO and ReMax."""
    model_path: Optional[str] = None     # null: the actor's initial checkpoint, with a fresh value head
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ppo_mini_batch_size: Optional[int] = 4  # prompts per critic optimizer step; null: one step per RL step
    ppo_micro_batch_size_per_device: int = 32  # rows per forward/backward; rounded to divide the mini-batch
    cliprange_value: float = 0.5         # new values stay within +-this of the old ones in the loss
    loss_agg_mode: str = "token-mean"    # one of vocab.AGG_MODES
    forward_micro_batch_size_per_device: int = 64  # rows per get and forward of critic_values
    max_tokens_per_micro_batch: Optional[int] = None  # as actor_config's, for the critic's forwards
    gradient_checkpointing: bool = False  # as actor_config's
    offload: OffloadConfig = field(default_factory=OffloadConfig)


@dataclass
class RewardModelConfig:
    """A learned reward: a one-label sequence classifier (`AutoModelForSequenceClassification`) that scores
    every response when `enable` is on, and the model that reward modeling (rl_config.algorithm:
    reward_modeling, cli/train_rm.py) trains. Never trained by RL, never synced, never checkpointed."""
    enable: bool = False                 # score rollouts with it (its MFC reward_model; rl_config.reward_weights)
    model_path: Optional[str] = None     # a one-label sequence classifier (cli/train_rm.py's <output_dir>/final);
                                         # reward modeling: the model it starts from (a causal LM gets a fresh head)
    backend: Optional[str] = None        # a train backend (torch, fsdp), run for inference; null: actor_config.backend
    dtype: str = "float32"
    micro_batch_size_per_device: int = 64  # rows per get and forward of its scores; reward modeling: pairs per forward
    lr: float = 1e-4                     # reward modeling only: AdamW, as the actor's
    weight_decay: float = 0.0            # reward modeling only
    grad_clip: float = 1.0               # reward modeling only
    mini_batch_size: Optional[int] = None  # reward modeling only: pairs per optimizer step; null: one step per step


@dataclass
class VLLMConfig:
    """generate_config.vllm: options of the vLLM rollout backend (engines/rollout/vllm_rollout.py)."""
    gpu_memory_utilization: float = 0.5  # CUDA: share of the GPU's memory vLLM may take
    kv_cache_gb: Optional[float] = 1.0   # CPU only: KV-cache size in GiB (null: 1.0); an accelerator's is what
                                         # gpu_memory_utilization leaves after the weights
    max_model_len: Optional[int] = None  # null: prompt + response lengths of this config
    enforce_eager: bool = True           # no CUDA graphs / torch.compile (always on CPU)
    enable_sleep_mode: bool = False      # CUDA: free the weights and KV cache between rollouts
    sleep_level: int = 1                 # 1: offload the weights, drop the KV cache; 2: drop both
    max_num_seqs: Optional[int] = None   # rows decoded together (null: vLLM's default)
    enable_prefix_caching: Optional[bool] = None  # automatic prefix caching (null: vLLM's default, on)
    disable_torch_compile: Optional[bool] = None  # torch.compile off in the rollout process (null: on CPU yes)
    engine_kwargs: dict = field(default_factory=dict)  # any other vllm.LLM(...) argument, passed as is
    serve: bool = False                  # vLLM as a server (AsyncLLM): every row a request, rows of all micro-batches
                                         # in flight share the slots (engines/rollout/vllm_serving.py)


@dataclass
class AgentConfig:
    """generate_config.agent: multi-turn rollouts with tool calls (mindspeed_rl/agent/, docs/agent.md)."""
    enable: bool = False                 # the rollout runs the agent loop: generate, call a tool, read its result, ...
    tools: list = field(default_factory=lambda: ["calc"])  # built-in names or dotted paths pkg.module:function
    max_turns: int = 3                   # generate turns per row (a call in the last turn is not run)
    syntax: str = "tags"                 # one of vocab.AGENT_SYNTAXES: tags (<calc>..</calc>) or json (<tool_call>)
    tool_timeout_s: float = 10.0         # a call not answered in this time gets an error result
    tool_choice: Optional[str] = None    # a tool's name: every response starts by calling it (the opening marker is
                                         # given, not sampled); null: the model decides (OpenAI's tool_choice)
    return_direct: list = field(default_factory=list)  # tools whose result is the final answer: the loop writes it
                                         # as the answer (not trained) and ends the row (LangChain's return_direct)


@dataclass
class ValGenerateConfig:
    """generate_config.val: how validation samples (trainer.val_interval, cli/evaluate.py); null: training's."""
    temperature: Optional[float] = None  # 0: greedy; null: generate_config.temperature
    top_p: Optional[float] = None        # null: generate_config.top_p
    top_k: Optional[int] = None          # null: generate_config.top_k
    n: int = 1                           # responses per prompt: val/pass@1 over them, val/pass@<n>
    max_new_tokens: Optional[int] = None  # null: generate_config.max_new_tokens
    pass_threshold: Optional[float] = None  # the reward at which a response passes (val/pass@k); null: 1.0, the
                                         # rule rewards' full score, and no pass@k when a reward model scores


@dataclass
class GenerateConfig:
    backend: str = "hf"                  # hf (transformers, KV cache) or vllm (generate_config.vllm)
    backend_options: dict = field(default_factory=dict)  # a plugin rollout backend's options (vllm: the vllm section)
    max_new_tokens: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0: off
    stop_tokens: list = field(default_factory=lambda: ["<eos>"])  # token strings that end a response
    micro_batch_size_per_device: int = 64  # rows per generate call; rounded down to whole prompt groups
    cuda_graphs: Optional[bool] = None   # hf: fixed-shape decode, a CUDA graph per batch bucket (null: on CUDA only;
                                         # true elsewhere runs the same loop eagerly)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    val: ValGenerateConfig = field(default_factory=ValGenerateConfig)


@dataclass
class WeightSyncConfig:
    """How trained weights reach the engines that read them (engines/sync/weight_sync.py)."""
    bucket_mb: int = 512                 # weights move a bucket of at most this many MiB at a time
    verify: bool = True                  # sha256 of the weights on both sides after each sync (small models)
    backend: str = "auto"                # auto: ipc when the trainer and every reader share one GPU, else the
                                         # device's collective (gloo/nccl/hccl); gloo: through the CPU; ipc:
                                         # buckets through CUDA IPC (shared memory on the CPU; engines/sync/ipc_sync.py)


@dataclass
class OverlongBufferConfig:
    """rl_config.overlong_buffer: DAPO's overlong shaping (algorithms/dapo.py)."""
    length: int = 0                      # tokens before max_new_tokens over which a penalty grows to -penalty_factor;
                                         # 0: no penalty
    penalty_factor: float = 1.0
    drop_truncated: bool = False         # responses cut by max_new_tokens leave the loss (loss_mask 0)


@dataclass
class RLConfig:
    algorithm: str = "grpo"              # the dataflow graph to run (mindspeed_rl.dataflow.registry)
    blocking: bool = False               # true: stages one after another; false: overlapped micro-batches
    guarantee_order: bool = True         # rows handed out in index order: blocking == non-blocking results
    n_samples_per_prompt: int = 8        # GRPO group size
    prompts_per_step: int = 16           # prompts per step (rows = prompts_per_step * n_samples_per_prompt)
    reward_fn: Optional[str] = "digits"  # built-in name or dotted path pkg.module:function; null: none (reward model only)
    # the reward that trains when reward_model.enable: sum of weight x score over {model, rule} (config/vocab.py
    # REWARD_SOURCES); without a reward model the rule reward alone trains, whatever these say
    reward_weights: dict = field(default_factory=lambda: {"model": 1.0, "rule": 0.0})
    adv_eps: float = 1e-6
    norm_adv_by_std: bool = True
    max_weight_staleness: int = 0        # rollout may use weights at most this many versions old
    partial_rollout: bool = False        # a weight sync does not wait for the micro-batches being generated: they
                                         # pause one decode step and go on with the new weights (needs
                                         # max_weight_staleness > 0, guarantee_order false; docs/async.md)
    dock_micro_batch_size: int = 32      # rows per get of reward/advantage; whole groups: rounded down to them
    gamma: float = 1.0                   # PPO's GAE discount
    lam: float = 1.0                     # PPO's GAE lambda
    dynamic_sampling: bool = False       # DAPO: drop groups whose rewards are all equal, draw more prompts
    max_oversample: float = 3.0          # dynamic sampling draws at most this x prompts_per_step prompts
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class DataConfig:
    dataset: str = "builtin:copy"        # builtin:<data.synthetic.KINDS>, or a .jsonl/.parquet path
    num_digits: int = 3                  # built-in tasks only
    size: int = 10000                    # built-in tasks only: prompts in the dataset
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    max_prompt_length: int = 64
    shuffle: bool = True
    chat_template: bool = False
    chosen_key: str = "chosen"           # reward modeling: a preference file's fields (with prompt_key)
    rejected_key: str = "rejected"
    eval_size: int = 0                   # reward modeling: records held out of the dataset for evaluation
    val_dataset: Optional[str] = None    # validation prompts: a .jsonl/.parquet path, or builtin:<kind> (its held-out
                                         # split, disjoint from training's); null: no validation
    val_size: int = 128                  # built-in val_dataset only: distinct held-out prompts (fewer if the task
                                         # has fewer)
    val_fraction: float = 0.0            # a dataset file only: this share of its prompts, by a hash of each, held
                                         # out of training as the validation set (val_dataset null); 0: none


@dataclass
class GroupConfig:
    """One worker group: the Ray actors that run some MFCs, with their resources."""
    mfcs: list = field(default_factory=list)
    num_cpus: float = 0.5                # per actor (fractional CPUs let several share a core)
    num_gpus: float = 0.0                # per actor (device.RAY_RESOURCES: which Ray resource each num_* asks for)
    num_npus: float = 0.0                # per actor
    dp: int = 1                          # data-parallel actors in the group
    torch_threads: int = 1               # torch.set_num_threads inside each actor
    device: str = "cpu"                  # one of device.WORKER_DEVICES: cpu, cuda, npu, auto
    cpu_affinity: Optional[list] = None  # Linux core ids every thread of the group's actors (and the processes they
                                         # start, vLLM's engine core among them) is bound to; null: not bound


@dataclass
class PlacementConfig:
    mode: str = "colocated"              # colocated, disaggregated, custom (groups below), or mesh (mfcs below)
    groups: dict = field(default_factory=dict)  # group name -> GroupConfig fields (override the mode's)
    mfcs: dict = field(default_factory=dict)    # mode mesh: MFC name -> {mesh, dp, tp, pp} (docs/parallel.md)
    n_nodes: int = 1                     # mode mesh: hosts in the cluster the meshes are drawn on
    n_devices_per_node: int = 2          # mode mesh: devices per host
    device_kind: str = "cpu"             # mode mesh: what a device is, one of device.DEVICE_KINDS: cpu (a slot of
                                         # CPUs), gpu, npu
    cpus_per_device: float = 0.5         # mode mesh: Ray CPUs per device slot (cpu) or per device (gpu/npu)
    device_memory_gb: Optional[float] = None  # memory of one device for the memory plan; null: by device kind
                                         # (device/kinds.py: H100 80, H200 141, 910B 64; cpu: not checked)
    check_memory: bool = True            # refuse a plan whose estimate exceeds a device's memory (false: warn)
    ray_address: Optional[str] = None    # null: start a local Ray
    ray_num_cpus: Optional[float] = None  # local Ray only; null: all cores


@dataclass
class Config:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    actor_config: ActorConfig = field(default_factory=ActorConfig)
    ref_config: RefConfig = field(default_factory=RefConfig)
    critic_config: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    generate_config: GenerateConfig = field(default_factory=GenerateConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    rl_config: RLConfig = field(default_factory=RLConfig)
    data: DataConfig = field(default_factory=DataConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
