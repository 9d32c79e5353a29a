"""The sections of `PolicyConfig`: optimizer, schedule, parallel layout, MoE, recompute,
micro-batching, refit and checkpoints. Each validates its own fields (`validate(prefix)`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from policyworker.config.convert import check as _check
from policyworker.config.convert import finite


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """Adam(W) through megatron-core's `get_megatron_optimizer`."""

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the learning rate for the linear/cosine decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam (beta1, beta2)."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW)."""
    use_distributed_optimizer: bool = False
    """Shard the optimizer state and fp32 master weights over data-parallel ranks (megatron's
    DistributedOptimizer: gradients reduce-scattered, parameters all-gathered after the step)."""
    overlap_grad_reduce: bool = False
    """Reduce each gradient bucket asynchronously as soon as its last micro-batch's backward has
    made it (megatron DDP's), overlapping the reduce with the rest of the backward in `train()`;
    a streamed step (`train_microbatch`) reduces once, at `finish_train_step`."""
    grad_reduce_in_fp32: bool = True
    """Keep DDP's gradient buffers (micro-batch accumulation and the data-parallel reduce) in
    fp32; false keeps them in the model's dtype — bf16 for a bf16 model, as NeMo-RL's Megatron
    recipes set it: half the buffer memory and reduce traffic, the sum of micro-batches rounded
    to bf16. Adam reads fp32 gradients either way (megatron copies bf16 ones up)."""
    overlap_param_gather: bool = False
    """With the distributed optimizer: all-gather the updated parameters bucket by bucket in
    the next forward's pre-hooks instead of at the end of the step. Refit, HF export,
    checkpoints, memory phases and the reference model complete the gather first themselves.
    Needs `use_distributed_optimizer` and `overlap_grad_reduce`, as megatron does."""

    def validate(self, prefix: str = "optimizer") -> None:
        _check(finite(self.lr) and self.lr > 0, f"{prefix}.lr", "a finite number > 0", self.lr)
        ok = finite(self.min_lr) and 0 <= self.min_lr <= self.lr
        _check(ok, f"{prefix}.min_lr", "in [0, lr]", self.min_lr)
        _check(
            len(self.betas) == 2 and all(finite(b) and 0 <= b < 1 for b in self.betas),
            f"{prefix}.betas",
            "two values in [0, 1)",
            self.betas,
        )
        _check(finite(self.eps) and self.eps > 0, f"{prefix}.eps", "a finite number > 0", self.eps)
        wd = self.weight_decay
        _check(finite(wd) and wd >= 0, f"{prefix}.weight_decay", "a finite number >= 0", wd)
        if self.overlap_param_gather:
            for needed in ("use_distributed_optimizer", "overlap_grad_reduce"):
                what = f"true when {prefix}.overlap_param_gather is true (megatron's requirement)"
                _check(getattr(self, needed), f"{prefix}.{needed}", what, False)


@dataclass(kw_only=True, slots=True)
class SchedulerConfig:
    """Learning-rate schedule; one step per global batch (megatron's OptimizerParamScheduler)."""

    style: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up: none, linear to `min_lr`, or cosine to `min_lr`."""
    warmup_steps: int = 0
    """Steps of linear warm-up from `warmup_init` to `lr`."""
    warmup_init: float = 0.0
    """The learning rate the warm-up starts from (NeMo-RL's `lr_warmup_init`)."""
    decay_steps: int = 1000
    """Steps (warm-up included) over which linear/cosine decay reaches `min_lr`."""

    def validate(self, prefix: str = "scheduler") -> None:
        styles = ("constant", "linear", "cosine")
        _check(self.style in styles, f"{prefix}.style", f"one of {styles}", self.style)
        _check(self.warmup_steps >= 0, f"{prefix}.warmup_steps", ">= 0", self.warmup_steps)
        w = self.warmup_init
        _check(finite(w) and w >= 0, f"{prefix}.warmup_init", "a finite number >= 0", w)
        _check(
            self.decay_steps > self.warmup_steps,
            f"{prefix}.decay_steps",
            "> warmup_steps",
            self.decay_steps,
        )


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Megatron parallel sizes; the data-parallel size is what remains of the world."""

    tensor_model_parallel_size: int = 1
    """Tensor parallel (TP) size."""
    pipeline_model_parallel_size: int = 1
    """Pipeline parallel (PP) size."""
    context_parallel_size: int = 1
    """Context parallel (CP) size."""
    expert_model_parallel_size: int = 1
    """Expert parallel (EP) size (MoE models): each EP rank holds num_experts / EP experts, and
    tokens travel to their experts' ranks. EP x ETP x PP must divide the world."""
    expert_tensor_parallel_size: int = 1
    """Expert tensor parallel (ETP) size: each expert's ffn split over this many ranks (1, as in
    the reference's recipes: whole experts; megatron's default would be the TP size)."""
    sequence_parallel: bool = False
    """Split norms, residuals and dropout along the sequence over the TP group (needs TP > 1);
    micro-batch lengths are padded to a multiple of TP."""

    def validate(self, prefix: str = "parallel") -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_size"):
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
                _check(ok, f"{prefix}.{f.name}", "an int >= 1", value)


@dataclass(kw_only=True, slots=True)
class MoEConfig:
    """Mixture-of-experts options, with the reference's names (no effect on a dense model)."""

    freeze_moe_router: bool = False
    """The routers get no gradient and no update: RL on the routing the model came with (the
    reference's remedy for logprob drift between trainer and engine)."""
    moe_router_dtype: Literal["fp32", "fp64"] | None = None
    """Router logits and their softmax in this dtype (None: the model's)."""
    moe_grouped_gemm: bool = True
    """Experts computed with one grouped GEMM per projection (`model/grouped_experts.py`);
    False: megatron's SequentialMLP, a GEMM pair per expert in a loop. The same parameters."""
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach their experts' EP ranks: all-to-all of each token to its experts, or
    all-gather of every token to every EP rank (no pipeline parallelism: megatron's allgather
    dispatcher needs fixed sequence lengths)."""
    moe_router_load_balancing_type: Literal["none", "aux_loss", "seq_aux_loss"] = "none"
    """The routers' load-balancing loss: none; aux_loss — over each micro-batch's tokens
    (megatron's and the reference's definition: it depends on how the batch is cut);
    seq_aux_loss — over each sequence (independent of micro-batches, packing and DP)."""
    moe_aux_loss_coeff: float = 0.0
    """Its weight; the gradient is normalized by the step's loss tokens, as the main loss."""
    moe_router_bias_update_rate: float = 0.0
    """How far a step moves each expert's routing bias (sigmoid routers: DeepSeek-V3, GLM-4.5)
    towards balance, megatron's aux-loss-free rule; 0 (the reference's default for RL): the
    bias stays as the checkpoint has it."""
    router_replay: bool = False
    """Router replay (R3; the reference's `router_replay.enabled`): get_logprobs and train take
    a batch's `routed_experts` [B, S, L, K] — the experts a generation engine sent each token
    to, in each MoE layer — and route exactly so; a token's row of -1 is left to the router."""

    def validate(self, prefix: str = "moe") -> None:
        _check(isinstance(self.freeze_moe_router, bool), f"{prefix}.freeze_moe_router",
               "true or false", self.freeze_moe_router)  # fmt: skip
        _check(isinstance(self.moe_grouped_gemm, bool), f"{prefix}.moe_grouped_gemm",
               "true or false", self.moe_grouped_gemm)  # fmt: skip
        _check(isinstance(self.router_replay, bool), f"{prefix}.router_replay",
               "true or false", self.router_replay)  # fmt: skip
        kinds = ("none", "aux_loss", "seq_aux_loss")
        _check(self.moe_router_load_balancing_type in kinds,
               f"{prefix}.moe_router_load_balancing_type", f"one of {kinds}",
               self.moe_router_load_balancing_type)  # fmt: skip
        c = self.moe_aux_loss_coeff
        _check(finite(c) and c >= 0, f"{prefix}.moe_aux_loss_coeff", "a finite number >= 0", c)
        r = self.moe_router_bias_update_rate
        _check(finite(r) and r >= 0, f"{prefix}.moe_router_bias_update_rate",
               "a finite number >= 0", r)  # fmt: skip
        _check(self.moe_token_dispatcher_type in ("alltoall", "allgather"),
               f"{prefix}.moe_token_dispatcher_type", "alltoall or allgather",
               self.moe_token_dispatcher_type)  # fmt: skip
        dtypes = (None, "fp32", "fp64")
        _check(self.moe_router_dtype in dtypes, f"{prefix}.moe_router_dtype",
               "fp32, fp64 or null", self.moe_router_dtype)  # fmt: skip

    @property
    def balance(self) -> str:
        """The load-balancing loss in effect ("none" without a positive coefficient)."""
        return "none" if self.moe_aux_loss_coeff == 0 else self.moe_router_load_balancing_type


RECOMPUTE_MODULES = ("core_attn", "mlp", "moe")
"""What selective recompute may name: megatron's modules of our layer spec (its "layernorm"
recompute needs Transformer Engine in megatron-core 0.19: its checkpoint reads TE's FP8 state)."""


@dataclass(kw_only=True, slots=True)
class RecomputeConfig:
    """Activation recompute, with the reference's names: activations inside a layer are dropped
    after the forward and recomputed in the backward (less memory, one more forward's work)."""

    activation_checkpointing: bool = False
    """Recompute on (off: every activation is kept until the backward)."""
    recompute_granularity: Literal["full", "selective"] = "full"
    """full: whole transformer layers, keeping only their input (by `recompute_method`);
    selective: only `recompute_modules`."""
    recompute_method: Literal["uniform", "block"] = "uniform"
    """For full (megatron's names): uniform — every layer of a pipeline stage, in checkpoints of
    `recompute_num_layers` layers; block — only the stage's first `recompute_num_layers` layers,
    one per checkpoint (the others keep their activations: less recompute, more memory)."""
    recompute_num_layers: int = 1
    """For full: layers per checkpoint (uniform) or layers recomputed (block); at most the layers
    of a pipeline stage. The defaults (uniform, 1) are what the reference sets."""
    recompute_modules: list[str] | None = None
    """For selective: some of core_attn, mlp, moe (None: core_attn, megatron's default)."""

    def validate(self, prefix: str = "recompute") -> None:
        _check(isinstance(self.activation_checkpointing, bool),
               f"{prefix}.activation_checkpointing", "true or false",
               self.activation_checkpointing)  # fmt: skip
        _check(self.recompute_granularity in ("full", "selective"),
               f"{prefix}.recompute_granularity", "full or selective",
               self.recompute_granularity)  # fmt: skip
        _check(self.recompute_method in ("uniform", "block"), f"{prefix}.recompute_method",
               "uniform or block", self.recompute_method)  # fmt: skip
        n = self.recompute_num_layers
        _check(isinstance(n, int) and not isinstance(n, bool) and n >= 1,
               f"{prefix}.recompute_num_layers", "an int >= 1", n)  # fmt: skip
        modules = self.recompute_modules
        ok = modules is None or (
            isinstance(modules, list) and all(m in RECOMPUTE_MODULES for m in modules)
        )
        _check(ok, f"{prefix}.recompute_modules", f"null or a list of {RECOMPUTE_MODULES}", modules)


def _check_budget(value: int | None, name: str) -> None:
    _check(
        value is None or (isinstance(value, int) and value >= 1), name, "an int >= 1 or null", value
    )


@dataclass(kw_only=True, slots=True)
class SequencePackingConfig:
    """Packing of variable-length sequences into THD bins (no padding between sequences)."""

    enabled: bool = False
    """Pack micro-batches instead of padding them (train and every logprob/top-k call)."""
    algorithm: Literal["first_fit_decreasing", "modified_first_fit_decreasing", "concatenative"] = (
        "modified_first_fit_decreasing"
    )
    """Bin-packing algorithm (data/packing.py)."""
    train_mb_tokens: int | None = None
    """Token budget of one training micro-batch on one rank (padded tokens); default
    train_micro_batch_size * max_total_sequence_length."""
    logprob_mb_tokens: int | None = None
    """Token budget of one logprob/top-k micro-batch; default
    logprob_batch_size * max_total_sequence_length."""
    make_sequence_length_divisible_by: int | None = None
    """Each packed sequence is padded to a multiple of this; default the least common multiple
    of 2*CP (with context parallelism) and TP (with sequence parallelism), else 1."""

    def validate(self, prefix: str = "sequence_packing") -> None:
        _check_budget(self.train_mb_tokens, f"{prefix}.train_mb_tokens")
        _check_budget(self.logprob_mb_tokens, f"{prefix}.logprob_mb_tokens")
        _check_budget(
            self.make_sequence_length_divisible_by, f"{prefix}.make_sequence_length_divisible_by"
        )


@dataclass(kw_only=True, slots=True)
class DynamicBatchingConfig:
    """Token-budget micro-batches without packing: rows sorted by length, each micro-batch padded
    to its own longest row and holding as many rows as fit the budget."""

    enabled: bool = False
    """Cut micro-batches by token budget instead of by row count."""
    train_mb_tokens: int | None = None
    """Budget of padded tokens (rows * longest) of one training micro-batch on one rank; default
    train_micro_batch_size * max_total_sequence_length."""
    logprob_mb_tokens: int | None = None
    """Budget of one logprob/top-k micro-batch; default
    logprob_batch_size * max_total_sequence_length."""

    def validate(self, prefix: str = "dynamic_batching") -> None:
        _check_budget(self.train_mb_tokens, f"{prefix}.train_mb_tokens")
        _check_budget(self.logprob_mb_tokens, f"{prefix}.logprob_mb_tokens")


@dataclass(kw_only=True, slots=True)
class RefitConfig:
    """Weight hand-over to a generation engine (`policyworker.refit`)."""

    timeout_s: float = 120.0
    """Seconds either side waits for the other before the refit fails (a dead peer is an error,
    never a hang); a call's `refit_timeout_s` overrides it."""
    buffer_size_bytes: int = 0
    """Bytes of a bucket, and of each of the two transfer buffers when the receiver does not
    share its staging; 0: from free device memory (a tenth of it, between 64 MiB and 2 GiB;
    64 MiB on CPU). A call's `buffer_size_bytes` overrides it."""
    checksum: bool = False
    """Checksum every bucket on the sending device and verify it on the receiver. Off by default:
    on an H200 it added 14-58% to a colocated refit (BENCHMARKS.md), over the 5% that would make
    it worth paying on every refit (the receiver must read every byte once more to verify, and
    the refit itself is one pass); turn it on to catch corrupted transfers."""

    def validate(self, prefix: str = "refit") -> None:
        t = self.timeout_s
        _check(finite(t) and t > 0, f"{prefix}.timeout_s", "a finite number > 0", t)
        ok = isinstance(self.buffer_size_bytes, int) and self.buffer_size_bytes >= 0
        _check(ok, f"{prefix}.buffer_size_bytes", "an int >= 0", self.buffer_size_bytes)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Distributed checkpoints (`save_checkpoint` / `load_checkpoint`, `policyworker.checkpoint`)."""

    async_save: bool = False
    """Return from `save_checkpoint` once the state is staged on the host; the write goes on in the
    background until `finalize_async_save()` (or the next save) commits it. A call's
    `async_save` overrides it."""
    verify_integrity: bool = True
    """Record a SHA-256 of every 1 GiB of every checkpoint file at save and check them at load, so
    a corrupted byte is an error, not silently wrong weights. The chunks are hashed in parallel
    (threads on every rank); the cost is in BENCHMARKS.md."""
    writer_threads: int = 4
    """Threads (and files) per rank and directory that write a checkpoint in parallel."""

    def validate(self, prefix: str = "checkpoint") -> None:
        n = self.writer_threads
        _check(isinstance(n, int) and n >= 1, f"{prefix}.writer_threads", "an int >= 1", n)


LORA_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The linear layers LoRA adapts, by megatron's names."""
HF_LORA_NAMES = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv",
                 "o_proj": "linear_proj", "gate_proj": "linear_fc1", "up_proj": "linear_fc1",
                 "down_proj": "linear_fc2"}  # fmt: skip
"""HF's names of the same layers: each selects the fused megatron layer it is part of."""
LORA_INITS = ("xavier", "kaiming", "normal", "zero")


@dataclass(kw_only=True, slots=True)
class PeftConfig:
    """LoRA adapters on a frozen base (NeMo-RL's `megatron_cfg.peft`, its keys and defaults):
    each adapted linear layer computes W x + (alpha / dim) · B A x."""

    enabled: bool = False
    target_modules: list[str] = dataclasses.field(default_factory=list)
    """Layers to adapt, by megatron's names (`linear_qkv`, `linear_proj`, `linear_fc1`,
    `linear_fc2`) or HF's (`q_proj`, ..., each selecting the fused layer it is part of); empty:
    all four."""
    exclude_modules: list[str] = dataclasses.field(default_factory=list)
    """Layers not to adapt, named the same way."""
    dim: int = 32
    """The adapters' rank."""
    alpha: float = 32
    """The update's scale is alpha / dim."""
    dropout: float = 0.0
    """Dropout on the adapter's path (training only)."""
    dropout_position: Literal["pre", "post"] = "pre"
    """Dropout on the adapter's input ("pre") or on its output ("post")."""
    lora_A_init_method: str = "xavier"
    """A's initialization: xavier (normal), kaiming (uniform), normal (std 0.02) or zero."""
    lora_B_init_method: str = "zero"
    """B's initialization (zero: a fresh adapter changes nothing)."""
    lora_dtype: Literal["float32", "bfloat16"] | None = None
    """The adapters' dtype (None: the model's)."""

    def modules(self) -> set[str]:
        """The megatron layers adapted."""
        chosen = {HF_LORA_NAMES.get(n, n) for n in self.target_modules} or set(LORA_MODULES)
        return chosen - {HF_LORA_NAMES.get(n, n) for n in self.exclude_modules}

    def validate(self, prefix: str = "peft") -> None:
        known = set(LORA_MODULES) | set(HF_LORA_NAMES)
        for key in ("target_modules", "exclude_modules"):
            names = getattr(self, key)
            bad = [n for n in names if n not in known]
            _check(not bad, f"{prefix}.{key}", f"names of {sorted(known)}", bad)
        _check(
            isinstance(self.dim, int) and self.dim >= 1, f"{prefix}.dim", "an int >= 1", self.dim
        )
        _check(finite(self.alpha) and self.alpha > 0, f"{prefix}.alpha", "a number > 0", self.alpha)
        d = self.dropout
        _check(finite(d) and 0 <= d < 1, f"{prefix}.dropout", "in [0, 1)", d)
        positions = ("pre", "post")
        _check(self.dropout_position in positions, f"{prefix}.dropout_position",
               f"one of {positions}", self.dropout_position)  # fmt: skip
        for key in ("lora_A_init_method", "lora_B_init_method"):
            value = getattr(self, key)
            _check(value in LORA_INITS, f"{prefix}.{key}", f"one of {LORA_INITS}", value)
        dtypes = (None, "float32", "bfloat16")
        _check(self.lora_dtype in dtypes, f"{prefix}.lora_dtype", f"one of {dtypes}",
               self.lora_dtype)  # fmt: skip
        if self.enabled:
            _check(bool(self.modules()), f"{prefix}.exclude_modules", "to leave a layer to adapt",
                   self.exclude_modules)  # fmt: skip


@dataclass(kw_only=True, slots=True)
class GenerationConfig:
    """Sampling in the worker (`generate`): the model that trains draws the responses, with a
    KV cache, no refit. The temperature is the policy's `temperature`."""

    max_new_tokens: int = 512
    """Tokens drawn per prompt at most; a row also stops at `max_total_sequence_length`."""
    top_k: int | None = None
    """Draw from the k most likely tokens only (None: all)."""
    top_p: float = 1.0
    """Draw from the smallest set of tokens whose probability reaches top_p (1.0: all)."""
    stop_token_ids: list[int] | None = None
    """A row ends after any of these tokens (kept in the output); None: the model's EOS."""
    stop_strings: list[str] | None = None
    """A row ends once its decoded response contains one of these (needs the tokenizer);
    a batch's `stop_strings` column adds per-row ones."""
    cuda_graphs: bool = True
    """On a GPU, run the decode steps as replays of one CUDA graph when the model is whole on
    each GPU (no TP, PP, CP or experts); otherwise, and with false, step by step."""
    decode_attention: Literal["sdpa", "triton"] = "triton"
    """A decode step's attention over the KV cache on a GPU: our Triton split-K kernel
    (`ops/decode_attention.py`: reads each row's written keys only), or SDPA's memory-efficient
    kernel under a mask (reads the cache up to the step's key length: under CUDA graphs its
    whole capacity; 1.7x slower generation at batch 256 on an H100). On the CPU always SDPA."""

    def validate(self, prefix: str = "generation") -> None:
        n = self.max_new_tokens
        ok = isinstance(n, int) and not isinstance(n, bool) and n >= 1
        _check(ok, f"{prefix}.max_new_tokens", "an int >= 1", n)
        k = self.top_k
        ok = k is None or (isinstance(k, int) and not isinstance(k, bool) and k >= 1)
        _check(ok, f"{prefix}.top_k", "null or an int >= 1", k)
        p = self.top_p
        _check(finite(p) and 0 < p <= 1, f"{prefix}.top_p", "a number in (0, 1]", p)
        ids = self.stop_token_ids
        ok = ids is None or all(isinstance(i, int) and i >= 0 for i in ids)
        _check(ok, f"{prefix}.stop_token_ids", "null or a list of token ids", ids)
        words = self.stop_strings
        ok = words is None or all(isinstance(w, str) and w for w in words)
        _check(ok, f"{prefix}.stop_strings", "null or a list of non-empty strings", words)
        _check(self.decode_attention in ("sdpa", "triton"), f"{prefix}.decode_attention",
               "sdpa or triton", self.decode_attention)  # fmt: skip
