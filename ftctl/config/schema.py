"""The structured schema of a run: every key a recipe or the command line may set.

Each field carries its documentation in ``metadata["help"]`` so that ``ftctl config-docs`` and the
error messages can quote it. Nothing here imports torch: the schema is checked before any model
loads.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING as OMEGA_MISSING


def option(default: Any = MISSING, help: str = "", *, factory: Any = None) -> Any:
    """A dataclass field with its documentation attached."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    name_or_path: str = option(OMEGA_MISSING, "Local model dir, hub id, or a built-in alias (`ftctl models`).")
    config_file: Optional[str] = option(
        None, "Architecture JSON shipped in recipes/model_configs, used to inspect a recipe without weights."
    )
    tokenizer: Optional[str] = option(None, "Tokenizer dir or id when it differs from the model's.")
    revision: Optional[str] = option(None, "Hub revision (branch, tag or commit) to load.")
    trust_remote_code: bool = option(False, "Allow the model repo's own Python code to run. Off unless set.")
    adapter: Optional[str] = option(
        None, "A trained LoRA/DoRA/QLoRA adapter (a run dir or its final/) to go on training instead of a fresh one "
        "(e.g. preference tuning after SFT); its own rank and target modules apply, method.r and the like do not.",
    )
    attn_implementation: str = option(
        "auto", "Attention kernel: auto (sdpa where the model class has it, else eager; packed runs then take "
        "data.packed_attention's kernel in place of sdpa), sdpa, eager, or flash_attention_2/3 on GPUs (needs flash-attn)."
    )


@dataclass
class MethodConfig:
    name: str = option("lora", "Fine-tuning method: full, lora, qlora or dora.")
    r: int = option(16, "LoRA rank (lora, qlora, dora).")
    alpha: float = option(32.0, "LoRA scaling numerator; the update is scaled by alpha / r.")
    dropout: float = option(0.05, "Dropout on the LoRA input path.")
    target_modules: List[str] = option(
        factory=lambda: ["all-linear"],
        help="Module names to adapt, or ['all-linear'] for every linear layer except the output head.",
    )
    use_dora: bool = option(False, "Weight-decomposed LoRA (magnitude + direction). True for method=dora.")
    use_rslora: bool = option(False, "Rank-stabilised scaling alpha / sqrt(r) instead of alpha / r.")
    modules_to_save: List[str] = option(factory=list, help="Extra modules trained in full next to the adapter.")
    quant_type: str = option("nf4", "qlora: 4-bit data type, nf4 or fp4.")
    double_quant: bool = option(True, "qlora: quantise the quantisation constants too.")
    quant_storage: str = option("uint8", "qlora: storage dtype of packed weights (bfloat16 for sharded backends).")


@dataclass
class ParallelConfig:
    name: str = option("single", "Backend: single, ddp, fsdp, zero1, zero2, zero3, or mesh (tensor/pipeline/expert parallel with FSDP2).")
    nproc_per_node: int = option(1, "Worker processes per node.")
    nnodes: int = option(1, "Number of nodes.")
    node_rank: int = option(0, "This node's rank among nnodes.")
    master_addr: str = option("127.0.0.1", "Address of the rank-0 node.")
    master_port: int = option(29500, "Port of the rank-0 node (multi-node runs; a one-node launch picks a free port).")
    rdzv_backend: str = option("static", "torchrun rendezvous backend: static or c10d.")
    rdzv_id: str = option("ftctl", "Rendezvous job id, shared by all nodes of one run.")
    dist_backend: str = option("auto", "Collective backend: auto (nccl on GPU, gloo on CPU), nccl or gloo.")
    offload_optimizer: Optional[str] = option(None, "ZeRO: offload optimizer states to 'cpu'.")
    offload_params: Optional[str] = option(None, "ZeRO-3 / FSDP: offload parameters to 'cpu'.")
    reshard_after_forward: bool = option(True, "FSDP: free gathered parameters after each layer's forward.")
    zero3_persistence_threshold: int = option(
        100000, "ZeRO-3: parameters with fewer elements stay whole on every rank (saves gathers of small tensors); 0 partitions all."
    )
    tp_size: int = option(
        1, "mesh: tensor-parallel ranks; each layer's weight matrices are split column- and row-wise over them by the "
        "model's own plan (transformers' base_model_tp_plan). Keep them within a node."
    )
    pp_size: int = option(1, "mesh: pipeline stages; the decoder layers are cut into this many consecutive stages.")
    ep_size: int = option(
        1, "mesh: expert-parallel ranks of MoE models, each holding 1/ep of the experts; taken out of dp_shard × tp "
        "(a multiple of tp_size that divides dp_shard_size × tp_size)."
    )
    dp_shard_size: int = option(
        -1, "mesh: data-parallel ranks that shard parameters, gradients and optimizer state (FSDP2); -1 = the rest of "
        "the world size after pp × dp_replicate × tp."
    )
    dp_replicate_size: int = option(1, "mesh: data-parallel replicas (HSDP: each replica shards over dp_shard_size ranks).")
    pp_schedule: str = option("1f1b", "mesh: pipeline schedule, gpipe, 1f1b or interleaved_1f1b (torch.distributed.pipelining).")
    pp_microbatches: int = option(0, "mesh: micro-batches per pipeline step; 0 = the gradient accumulation steps.")
    pp_stages_per_rank: int = option(2, "mesh, interleaved_1f1b: pipeline stages each pipeline rank runs (looped).")


@dataclass
class PrecisionConfig:
    name: str = option("auto", "fp32, bf16, fp16 (with a gradient scaler) or auto.")
    init_scale: float = option(65536.0, "fp16: initial loss scale.")
    growth_interval: int = option(2000, "fp16: steps without overflow before the scale doubles.")


@dataclass
class MixtureSource:
    path: str = option(OMEGA_MISSING, "A source as data.path takes it: file, directory, saved dataset or hub id.")
    format: Optional[str] = option(None, "Its record format (or auto); default data.format.")
    weight: float = option(1.0, "Its share of the training examples, relative to the other sources' weights.")
    split: Optional[str] = option(None, "Saved dataset dicts and hub datasets: the split; default data.split.")
    subset: Optional[str] = option(None, "Hub datasets: the subset (configuration); default data.subset.")


@dataclass
class EvalSet:
    """One named eval set of data.eval_sets; a bare path stands for {path: PATH}."""

    path: str = option(OMEGA_MISSING, "A source as data.path takes it: file, directory, saved dataset or hub id.")
    format: Optional[str] = option(None, "Its record format; default data.format.")
    split: Optional[str] = option(None, "Saved dataset dicts and hub datasets: the split; default data.eval_split.")
    subset: Optional[str] = option(None, "Hub datasets: the subset (configuration); default data.subset.")
    metric: str = option(
        "auto", "What `ftctl eval` scores it by: auto, exact_match, json_match, rouge_l, perplexity, or several "
        "joined by commas; training logs its loss, and its perplexity when listed here."
    )


@dataclass
class DataConfig:
    format: str = option(
        "auto", "Record format, a module in data_formats/: alpaca, sharegpt, openai, text, ...; auto (the default) detects "
        "each file's (and each mixture source's) from its first record and logs why."
    )
    path: Optional[str] = option(
        None,
        "Training data: a .json/.jsonl/.parquet file, a directory of them, a datasets.save_to_disk directory, "
        "or a Hugging Face dataset id (hf://org/name or org/name). Unused when data.mixture is set.",
    )
    split: str = option("train", "Split to train on, for a save_to_disk DatasetDict or a hub dataset.")
    subset: Optional[str] = option(None, "Hub dataset subset (its configuration name), when it has several.")
    mixture: List[MixtureSource] = option(
        factory=list,
        help="Several sources mixed by weight, e.g. [{path: a.jsonl, weight: 3}, {path: b.jsonl, format: sharegpt}]; "
        "each epoch draws every source's share of the examples (seeded).",
    )
    eval_path: Optional[str] = option(None, "Separate eval data (same format), any source data.path takes.")
    eval_split: str = option("test", "Split of data.eval_path to evaluate on, for a save_to_disk DatasetDict or a hub dataset.")
    eval_fraction: float = option(0.0, "Share of the training file held out for eval when eval_path is unset.")
    eval_sets: Dict[str, Any] = option(
        factory=dict,
        help="Named eval sets besides data.eval_path / eval_fraction, each logged as eval/<name>_loss: {name: source} "
        "or {name: {path, format, split, subset, metric}}, e.g. {orders: a.jsonl, chat: {path: b.jsonl, format: sharegpt}}.",
    )
    max_seq_len: int = option(512, "Tokens per example; longer examples are truncated and counted.")
    train_on_prompt: bool = option(False, "Also train on system and user tokens.")
    chat_template: Optional[str] = option(
        None,
        "Chat template overriding the tokenizer's: a name (chatml, llama3, mistral, gemma, phi3, alpaca), a Jinja "
        "string or a .jinja file; the documented fallback is used when neither exists.",
    )
    add_special_tokens: bool = option(
        False, "Add the named chat_template's special tokens the tokenizer splits (e.g. llama3's <|eot_id|> on another "
        "family's tokenizer) as tokens: the embeddings and output head grow and train (adapters: through modules_to_save)."
    )
    system_prompt: Optional[str] = option(None, "System message added to examples that carry none.")
    pad_to_multiple_of: int = option(8, "Pad each micro-batch to a multiple of this many tokens.")
    packing: bool = option(
        False,
        "Pack each micro-batch's examples into shared rows of up to max_seq_len tokens instead of padding "
        "them; attention stays inside each example, so the loss is unchanged and padding is removed.",
    )
    packed_attention: str = option(
        "auto",
        "Kernel of packed attention on sdpa models: auto (CUDA: flash_varlen if flash-attn is installed, else "
        "torch's varlen, else flex, the first that takes the precision: the varlen kernels take only bf16/fp16; "
        "CPU: sdpa), flash_varlen, varlen, flex or sdpa (causal SDPA per example).",
    )
    shuffle: bool = option(True, "Shuffle examples every epoch (seeded).")
    cache_dir: Optional[str] = option(None, "Tokenized-data cache; default $FTCTL_HOME/data_cache.")
    max_record_bytes: int = option(
        1_000_000, "Records whose JSON text is longer are skipped and counted, without being held in memory; 0 = no limit."
    )


@dataclass
class ObjectiveConfig:
    name: str = option("sft", "What the loss asks for: sft (next-token cross-entropy, the default), dpo, simpo, orpo or kto.")
    loss_type: str = option("sigmoid", "dpo: sigmoid (DPO), ipo, hinge (SLiC) or robust (rDPO).")
    beta: float = option(
        0.1, "dpo, kto: strength of the pull towards the reference model; simpo: reward scale; the implicit reward is "
        "beta × (policy − reference) log-probability (simpo: beta × the mean token log-probability)."
    )
    label_smoothing: float = option(
        0.0, "dpo sigmoid and robust, simpo: assumed share of pairs whose labels are flipped (conservative DPO), in [0, 0.5)."
    )
    gamma: float = option(0.5, "simpo: the target reward margin between chosen and rejected answers.")
    orpo_lambda: float = option(0.1, "orpo: weight λ of the odds-ratio term next to the chosen answer's NLL.")
    desirable_weight: float = option(1.0, "kto: weight of the losses of desirable (label true) examples.")
    undesirable_weight: float = option(1.0, "kto: weight of the losses of undesirable (label false) examples.")
    sft_weight: float = option(
        0.0, "dpo, simpo, kto: add this times the chosen (kto: desirable) answer's mean token NLL to each example's loss (RPO); 0 = off."
    )
    precompute_reference: bool = option(
        False, "dpo, kto: compute the reference model's log-probs in one pass before training and cache them on disk "
        "($FTCTL_HOME/reference_cache, keyed by the tokenized data, the base model and the adapter); later runs and "
        "resumes reuse them and no reference model stays in memory while training.",
    )


@dataclass
class TrainConfig:
    max_steps: Optional[int] = option(
        None, "Optimizer steps to run; null means 100 unless train.epochs is set. Set this or train.epochs, not both."
    )
    epochs: Optional[float] = option(
        None, "Passes over the training set instead of max_steps: steps = ceil(epochs × train examples ÷ global_batch_size), "
        "counted after tokenization."
    )
    micro_batch_size: int = option(1, "Examples per forward pass on one rank.")
    global_batch_size: int = option(8, "Examples per optimizer step over all ranks; accumulation is derived.")
    lr: float = option(2e-4, "Peak learning rate.")
    min_lr_ratio: float = option(0.1, "Floor of the cosine and linear decay as a fraction of lr.")
    lr_scheduler: str = option(
        "cosine", "After warmup: cosine, linear, cosine_restarts, wsd or constant. cosine/linear decay to min_lr_ratio × lr; "
        "cosine_restarts runs train.lr_cycles cosines, each restarting at lr; wsd (warmup-stable-decay) holds lr until "
        "the last train.wsd_decay_ratio of the steps, then decays (train.wsd_decay_shape) to min_lr_ratio × lr at the last step."
    )
    lr_cycles: int = option(1, "cosine_restarts: cosine cycles over the steps after warmup; 1 is plain cosine.")
    wsd_decay_ratio: float = option(0.1, "wsd: share of the run's steps (rounded up) in the final decay, in (0, 1).")
    wsd_decay_shape: str = option("linear", "wsd: shape of the final decay: linear, cosine or 1-sqrt.")
    warmup_steps: int = option(0, "Linear warmup steps before the decay. Set this or train.warmup_ratio, not both.")
    warmup_ratio: float = option(0.0, "Warmup as a share of the run's steps (rounded up), instead of warmup_steps.")
    weight_decay: float = option(
        0.0, "Weight decay of matrices (biases and norms are not decayed): decoupled for AdamW, Adafactor, Lion and "
        "schedule-free AdamW, an L2 term in the gradient for SGD (torch's)."
    )
    adam_beta1: float = option(0.9, "beta1 of AdamW, Lion and schedule-free AdamW (as in transformers' Trainer).")
    adam_beta2: float = option(0.999, "beta2 of AdamW, Lion (its paper uses 0.99) and schedule-free AdamW.")
    adam_eps: float = option(1e-8, "AdamW and schedule-free AdamW epsilon.")
    optimizer: str = option(
        "adamw", "adamw, adamw_8bit, paged_adamw_8bit, paged_adamw_32bit, adafactor, lion, lion_8bit, sgd or "
        "schedule_free_adamw. bitsandbytes: the 8-bit/paged AdamWs (paged: CUDA only) and Lion (a 3-10× smaller lr than "
        "AdamW), not with FSDP; torch's Adafactor (single and DDP); sgd (train.sgd_momentum, train.sgd_nesterov); "
        "schedule_free_adamw (needs train.lr_scheduler=constant; evaluates and saves its averaged weights; not with ZeRO)."
    )
    sgd_momentum: float = option(0.0, "sgd: momentum factor; 0 is plain SGD.")
    sgd_nesterov: bool = option(False, "sgd: Nesterov momentum (needs sgd_momentum > 0).")
    max_grad_norm: float = option(1.0, "Gradient clipping norm; 0 disables clipping.")
    gradient_checkpointing: bool = option(False, "Recompute activations in backward to save memory.")
    gradient_checkpointing_every: int = option(
        1, "With gradient_checkpointing: checkpoint every k-th decoder layer only (layers 0, k, 2k, ...); the others "
        "keep their activations. 1 checkpoints all; larger trades memory back for speed."
    )
    neftune_alpha: float = option(
        0.0, "NEFTune: uniform noise of magnitude alpha / sqrt(L × d) added to the input embeddings in training "
        "forwards only (L the batch's padded or packed row length, d the hidden size); 0 = off. The paper uses 5-15."
    )
    kernels: str = option(
        "ftctl", "ftctl (its own one-node RMSNorm and chunked head loss, any device) or liger (liger-kernel's Triton "
        "RMSNorm, SwiGLU, RoPE and fused linear cross-entropy; CUDA only, pip install 'ftctl[liger]')."
    )
    log_every: int = option(1, "Write a metrics line every this many steps.")
    eval_every: int = option(0, "Eval loss every this many steps; 0 = only at the end when an eval split exists.")
    save_every: int = option(
        200, "Checkpoint every this many steps (and always at the last step, so that every run can be resumed or "
        "extended); 0 = only at the last step."
    )
    keep_last: int = option(2, "Checkpoints to keep, newest first (each is weights + optimizer state); 0 keeps all.")
    keep_best: bool = option(
        False, "Keep the weights of the best eval so far by train.best_metric in output_dir/best/ (with best.json); "
        "final/ stays the last step's."
    )
    best_metric: str = option(
        "eval_loss", "What keep_best and early stopping compare, lower is better: eval_loss (data.eval_path or "
        "eval_fraction), eval/<name>_loss or eval/<name>_perplexity of a data.eval_sets entry."
    )
    early_stopping_patience: int = option(
        0, "Stop after this many evals in a row without a better train.best_metric (0 = never stop early); the run "
        "still saves final/ and a checkpoint of that step."
    )
    early_stopping_threshold: float = option(
        0.0, "How much lower train.best_metric must be than the best so far to count as better (for keep_best too)."
    )
    progress_bar: bool = option(True, "Show a progress bar on rank 0 when stderr is a terminal (FTCTL_PROGRESS=1 forces it).")
    tensorboard: bool = option(True, "Deprecated: false drops tensorboard from report_to.")
    report_to: List[str] = option(
        factory=lambda: ["tensorboard"],
        help="Trackers that receive every metrics line: tensorboard (output_dir/tensorboard), wandb (offline into "
        "output_dir/wandb without network or credentials), mlflow (MLFLOW_TRACKING_URI, else output_dir/mlruns); [] for none.",
    )
    plot: bool = option(True, "Draw output_dir/loss_curve.png when the run ends (needs matplotlib; `ftctl plot RUN_DIR` redraws it).")
    max_nonfinite_steps: int = option(
        0, "Steps with a NaN/inf loss or gradient to skip before stopping; the update of such a step is never applied."
    )
    stop_on_divergence: bool = option(
        True, "Stop a run whose loss collapsed to ln(vocab size) with zero gradients, or stayed above its start for "
        "train.divergence_window steps, keeping its last good checkpoint; false warns once and goes on."
    )
    divergence_window: int = option(20, "Steps in a row the loss must stay above its start to count as diverged; 0 disables that check.")
    num_threads: int = option(0, "torch CPU threads per process; 0 = torch's default.")
    compile: bool = option(
        False, "torch.compile each decoder layer on its own (regional compilation); pays off only on long runs."
    )


@dataclass
class RunConfig:
    model: ModelConfig = option(factory=ModelConfig, help="What to fine-tune.")
    method: MethodConfig = option(factory=MethodConfig, help="How: full, LoRA, QLoRA or DoRA.")
    parallel: ParallelConfig = option(factory=ParallelConfig, help="On how many processes, with which backend.")
    precision: PrecisionConfig = option(factory=PrecisionConfig, help="Numeric precision of the compute.")
    data: DataConfig = option(factory=DataConfig, help="What to train on.")
    objective: ObjectiveConfig = option(factory=ObjectiveConfig, help="What the loss asks for: SFT or a preference objective.")
    train: TrainConfig = option(factory=TrainConfig, help="The optimisation loop.")
    output_dir: str = option("runs/${now:%Y%m%d-%H%M%S}", "Run directory: config, metrics, checkpoints, final/.")
    seed: int = option(42, "Seed for data order, initialisation and dropout.")
    overwrite: bool = option(False, "Start over in a non-empty output_dir, deleting its checkpoints and results.")
    resume: Optional[str] = option(
        None, "Continue a run: 'auto' (latest complete checkpoint in output_dir) or a checkpoint dir."
    )


METHODS = ("full", "lora", "qlora", "dora")
OBJECTIVES = ("sft", "dpo", "simpo", "orpo", "kto")
#: Objectives trained on preference data (pairs, or KTO's labelled completions) rather than conversations.
PREFERENCE_OBJECTIVES = ("dpo", "simpo", "orpo", "kto")
#: Objectives whose loss compares the policy with a frozen reference model.
REFERENCE_OBJECTIVES = ("dpo", "kto")
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
PARALLEL_BACKENDS = ("single", "ddp", "fsdp", "zero1", "zero2", "zero3", "mesh")
PRECISIONS = ("fp32", "bf16", "fp16", "auto")
LR_SCHEDULERS = ("cosine", "linear", "constant", "cosine_restarts", "wsd")
WSD_DECAY_SHAPES = ("linear", "cosine", "1-sqrt")
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adafactor", "lion", "lion_8bit", "sgd",
              "schedule_free_adamw")
KERNELS = ("ftctl", "liger")
#: Steps a run takes when neither train.max_steps nor train.epochs is set.
DEFAULT_MAX_STEPS = 100
TRACKERS = ("tensorboard", "wandb", "mlflow")
PACKED_ATTENTION_KERNELS = ("auto", "flash_varlen", "varlen", "flex", "sdpa")
ATTENTION_KERNELS = ("auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
