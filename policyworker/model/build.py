"""Build a megatron-core GPTModel for a Hugging Face decoder, dense or mixture-of-experts.

All model construction lives here (GPTModel is deprecated in mcore 0.19; a switch stays local).
The layer spec is megatron's own modules (SelfAttention, MLP, Column/RowParallelLinear; for
experts MoELayer with its router, token dispatcher and SequentialMLP experts) with our SDPA core
attention and HF-exact RMSNorm, so no Transformer Engine is needed.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.activations import quick_gelu
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention,
    MLASelfAttentionSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from policyworker.config import MoEConfig, RecomputeConfig
from policyworker.model.attention.core import CoreAttention
from policyworker.model.chunked_mlp import ChunkedMLP
from policyworker.model.grouped_experts import GroupedExperts, GroupedMoELayer
from policyworker.model.hf_config import LatentShape, ModelShape, MoEShape
from policyworker.model.latent import DuplicatedLinear, LatentNorm
from policyworker.model.linear_attention import GatedDeltaNet
from policyworker.model.lora import ADAPTER
from policyworker.model.norm import RMSNorm, ZeroCenteredRMSNorm
from policyworker.model.paths import ForwardPaths
from policyworker.model.rope_scaling import rope_frequencies
from policyworker.ops.logprobs import Head
from policyworker.parallel.dims import ParallelDims


def transformer_config(
    shape: ModelShape,
    *,
    dims: ParallelDims,
    params_dtype: torch.dtype,
    on_gpu: bool,
    moe: MoEConfig | None = None,
    recompute: RecomputeConfig | None = None,
) -> TransformerConfig:
    """megatron's TransformerConfig for `shape` (an MLATransformerConfig for latent attention);
    fusions that need apex/TE are off."""
    bf16 = params_dtype == torch.bfloat16
    config = MLATransformerConfig if shape.latent is not None else TransformerConfig
    return config(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        layernorm_epsilon=shape.rms_norm_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,
        add_bias_linear=shape.arch.linear_bias,
        add_qkv_bias=shape.arch.qkv_bias,
        softmax_type="learnable" if shape.sinks else "vanilla",
        attention_output_gate=shape.arch.output_gate,
        qk_layernorm=shape.arch.qk_norm or shape.latent is not None,  # MLA: the latents' norms
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=params_dtype,
        bf16=bf16,
        pipeline_dtype=params_dtype,
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp,
        sequence_parallel=dims.sp,
        # Micro-batches are trimmed to their longest sequence: stages exchange shapes first.
        variable_seq_lengths=dims.pp > 1,
        use_cpu_initialization=not on_gpu,
        perform_initialization=False,  # weights always come from the HF checkpoint
        bias_activation_fusion=on_gpu,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        # Loss is already normalized by global token counts: DDP must sum, not average.
        calculate_per_token_loss=True,
        # Gated DeltaNet and attention layers share parameter names with other shapes: each
        # layer its own checkpoint keys (megatron stacks the layers' tensors otherwise)
        hetereogenous_dist_checkpoint=bool(shape.linear_layers),
        **moe_fields(shape.moe, moe or MoEConfig()),
        **recompute_fields(recompute or RecomputeConfig()),
        **latent_fields(shape.latent),
        **activation_fields(shape.swiglu_clamp),
    )


def activation_fields(clamp: float) -> dict[str, Any]:
    """The gated MLP's activation: silu(gate) * up, or gpt-oss's clamped form — megatron's
    quick_gelu (x * sigmoid(1.702 x)) of the gate times (up + 1), both clamped to `clamp`."""
    if not clamp:
        return dict(activation_func=F.silu)
    return dict(
        activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=clamp
    )


def latent_fields(latent: LatentShape | None) -> dict[str, Any]:
    """MLATransformerConfig's dimensions (its RoPE is our core attention's: `compat/mla.py`)."""
    if latent is None:
        return {}
    return dict(
        multi_latent_attention=True,
        q_lora_rank=latent.q_lora_rank or None,
        kv_lora_rank=latent.kv_lora_rank,
        qk_head_dim=latent.nope_dim,
        qk_pos_emb_head_dim=latent.rope_dim,
        v_head_dim=latent.v_dim,
        rope_type="rope",
        # megatron's MLA scales its softmax by YaRN's mscale from these two (its RoPE: ours)
        rotary_scaling_factor=latent.mscale[0],
        mscale_all_dim=latent.mscale[1],
    )


def recompute_fields(cfg: RecomputeConfig) -> dict[str, Any]:
    """TransformerConfig's recompute settings: full (whole layers, by `recompute_method`; the
    defaults, uniform over single layers, are what the reference sets) or selective (the named
    modules); none when off."""
    if not cfg.activation_checkpointing:
        return {}
    if cfg.recompute_granularity == "full":
        return dict(
            recompute_granularity="full",
            recompute_method=cfg.recompute_method,
            recompute_num_layers=cfg.recompute_num_layers,
        )
    modules = ["core_attn"] if cfg.recompute_modules is None else list(cfg.recompute_modules)
    return dict(recompute_granularity="selective", recompute_modules=modules)


def moe_fields(moe: MoEShape | None, cfg: MoEConfig) -> dict[str, Any]:
    """TransformerConfig's expert settings for HF's routing (its rule's, `model/router_rules.py`;
    the expert bias moves by `moe_router_bias_update_rate` per step). A dense model: none."""
    if moe is None:
        return {"moe_token_dispatcher_type": "alltoall"}  # "allgather" refuses variable lengths
    return dict(
        moe_router_dtype=cfg.moe_router_dtype,
        moe_token_dispatcher_type=cfg.moe_token_dispatcher_type,
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.expert_ffn_size,
        **moe.rule.megatron_fields(),
        moe_router_bias_update_rate=cfg.moe_router_bias_update_rate,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_size or None,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_grouped_gemm=False,
        # Dense layers among MoE ones (our layer specs say which): checkpoints then key each
        # layer on its own instead of stacking unlike layers.
        moe_layer_freq=1 if all(moe.layers) else [int(x) for x in moe.layers],
    )


def layer_spec(
    shape: ModelShape, layers: range, *, grouped: bool = False
) -> TransformerBlockSubmodules:
    """Pre-norm decoder layers of megatron modules for `layers` of `shape` (a pipeline stage's),
    plus the final norm. Per layer: its attention (self-attention with our core attention and
    its sliding window; multi-head latent attention; or a Gated DeltaNet layer) and its MLP (an
    MoE layer of megatron's modules, or a dense one). `grouped`: the experts run on grouped
    GEMMs (`GroupedExperts`), not SequentialMLP's loop, in a `GroupedMoELayer` (no host sync per
    layer where every expert is local). The norms are zero-centered where the family's are."""
    norm = ZeroCenteredRMSNorm if shape.arch.zero_centered_norm else RMSNorm
    dense = partial(
        ChunkedMLP.as_mlp_submodule,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )
    moe: Any = None
    if shape.moe is not None:
        moe = get_moe_module_spec(
            use_te=False, num_experts=shape.moe.num_experts, moe_grouped_gemm=False
        )
    if moe is not None and grouped:  # the same submodules, GroupedExperts in SequentialMLP's
        parts = moe.keywords["submodules"]
        grouped_experts = partial(GroupedExperts, **parts.experts.keywords)
        moe = partial(GroupedMoELayer, submodules=replace(parts, experts=grouped_experts))
    specs = []
    for i in layers:
        is_moe = shape.moe is not None and shape.moe.layers[i]
        parts = TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=_mixer(shape, i, norm),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=moe if is_moe else dense,
            mlp_bda=get_bias_dropout_add,
        )
        specs.append(ModuleSpec(module=TransformerLayer, submodules=parts))
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm)


def _mixer(shape: ModelShape, i: int, norm: type) -> ModuleSpec:
    """Layer `i`'s token mixer: a Gated DeltaNet layer, multi-head latent attention (down-
    projections to the latents, their norms, up-projections) or self-attention of megatron's
    modules with our core attention (its window, if any)."""
    if shape.linear_layers and shape.linear_layers[i]:
        return ModuleSpec(module=GatedDeltaNet, params={"shape": shape.delta_net})
    latent = shape.latent
    if latent is not None:
        return ModuleSpec(
            module=MLASelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=MLASelfAttentionSubmodules(
                linear_q_proj=ColumnParallelLinear,
                linear_q_down_proj=DuplicatedLinear,
                linear_q_up_proj=ColumnParallelLinear,
                linear_kv_down_proj=DuplicatedLinear,
                linear_kv_up_proj=ColumnParallelLinear,
                core_attention=CoreAttention,
                linear_proj=RowParallelLinear,
                q_layernorm=LatentNorm if latent.q_lora_rank else IdentityOp,
                kv_layernorm=LatentNorm,
            ),
        )
    qk = norm if shape.arch.qk_norm else IdentityOp
    window = shape.windows[i] if shape.windows else 0
    core = partial(CoreAttention, window=window) if window else CoreAttention
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=core,
            linear_proj=RowParallelLinear,
            q_layernorm=qk,
            k_layernorm=qk,
        ),
    )


def build_gpt_model(
    hf_config: Any,
    shape: ModelShape,
    *,
    dims: ParallelDims,
    params_dtype: torch.dtype,
    max_seq_len: int,
    pre_process: bool = True,
    post_process: bool = True,
    moe: MoEConfig | None = None,
    recompute: RecomputeConfig | None = None,
    mlp_chunk_tokens: int | None = None,
    paths: ForwardPaths,
) -> GPTModel:
    """A GPTModel with this rank's shard of `shape`, on the current device, weights unset; with
    `moe.freeze_moe_router` its routers take no gradient; its dense MLPs run `mlp_chunk_tokens`
    tokens at a time while scoring or generating (`ChunkedMLP`); its attention runs the phases
    of `paths`."""
    on_gpu = torch.cuda.is_available()
    moe = moe or MoEConfig()
    config = transformer_config(
        shape,
        dims=dims,
        params_dtype=params_dtype,
        on_gpu=on_gpu,
        moe=moe,
        recompute=recompute,
    )
    # This pipeline stage's share of the layers, as megatron splits them.
    first, count = get_transformer_layer_offset(config), get_num_layers_to_build(config)
    spec = layer_spec(shape, range(first, first + count), grouped=moe.moe_grouped_gemm)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.padded_vocab_size(dims.tp),
        max_sequence_length=max(max_seq_len, shape.max_position_embeddings),
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="none",  # RoPE is applied in our core attention
    )
    # HF's frequencies (llama3's and YaRN's scaling included), not megatron's.
    rope = rope_frequencies(hf_config, shape.rotary_dim or shape.head_dim)
    paths.install(model, rope, torch.device("cuda" if on_gpu else "cpu"), mlp_chunk_tokens)
    for name, param in model.named_parameters():  # before DDP and the optimizer see them
        if moe.freeze_moe_router and name.endswith(".mlp.router.weight"):
            param.requires_grad_(False)
        if ".mlp.experts." in name:
            # Routed experts are expert-parallel parameters in every layout (megatron marks them
            # so only with EP > 1 or expert TP != TP): their gradients sum over the expert
            # data-parallel group (the data-parallel group itself when EP = 1 and ETP = TP: the
            # same sum) and the optimizer keeps them in a part of their own, so that checkpoints
            # of any EP layout have the same structure and load into each other.
            param.allreduce = False
    if on_gpu:
        model.cuda(torch.cuda.current_device())
    return model


def global_named_weights(model: GPTModel) -> dict[str, torch.Tensor]:
    """`global_named_parameters` and the weights megatron keeps as buffers: a sigmoid router's
    expert bias (`mlp.router.expert_bias`, fp32; set from the checkpoint, moved by its own
    update rule, never by the optimizer)."""
    out: dict[str, torch.Tensor] = {
        n: p for n, p in global_named_parameters(model).items() if ADAPTER not in n
    }  # LoRA's adapters are not the model's weights (`model/lora.py`)
    for layer in model.decoder.layers:
        if isinstance(layer.mlp, MoELayer) and layer.mlp.router.expert_bias is not None:
            name = f"decoder.layers.{layer.layer_number - 1}.mlp.router.expert_bias"
            out[name] = layer.mlp.router.expert_bias
    return out


def global_named_parameters(model: GPTModel) -> dict[str, torch.nn.Parameter]:
    """`named_parameters()` with this rank's layer and expert indices made global.

    Pipeline stage k numbers its layers from 0, and expert-parallel rank r its experts; the HF
    mapping names the model's layers 0..L-1 and each layer's experts 0..E-1.
    """
    renames = {}  # local prefix -> global prefix
    for i, layer in enumerate(model.decoder.layers):
        local, number = f"decoder.layers.{i}.", layer.layer_number - 1
        renames[local] = f"decoder.layers.{number}."
        if isinstance(layer.mlp, MoELayer):
            for j, e in enumerate(layer.mlp.local_expert_indices):
                renames[f"{local}{_EXPERTS}{j}."] = f"decoder.layers.{number}.{_EXPERTS}{e}."
    out = {}
    for name, param in model.named_parameters():
        if name.startswith("decoder.layers."):
            parts = name.split(".")  # decoder.layers.{i}[.mlp.experts.local_experts.{j}]...
            depth = 7 if ".".join(parts[3:6]) + "." == _EXPERTS else 3
            local = ".".join(parts[:depth]) + "."
            name = renames[local] + name[len(local) :]
        out[name] = param
    return out


_EXPERTS = "mlp.experts.local_experts."


def output_head(
    *,
    hidden_states: torch.Tensor,
    output_layer: ColumnParallelLinear,
    output_weight: torch.Tensor | None,
    **unused: Any,
) -> Head:
    """GPTModel `output_processor`: the last stage's output as a `Head` — the decoder's final
    hidden states, batch-major [B, S, H], and this TP rank's output-layer rows [V/tp, H] — so
    the logits are made where they are read, chunk by chunk (`ops.logprobs`).

    Batch-major: megatron's default makes [S, B, V] logits, then a contiguous [B, S, V] copy of
    them; transposing the hidden states instead moves H/V as many bytes. The TP wiring is the
    output layer's own: under sequence parallelism the hidden states arrive as [S/tp, B, H] and
    are all-gathered along the sequence (the backward reduce-scatters, summing the TP ranks'
    partial gradients); otherwise the backward all-reduces them over TP.
    """
    if output_layer.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(
            hidden_states, tensor_parallel_output_grad=True
        )
    elif output_layer.tp_group is not None and output_layer.tp_group.size() > 1:
        hidden = copy_to_tensor_model_parallel_region(hidden_states, group=output_layer.tp_group)
    else:
        hidden = hidden_states
    weight = output_layer.weight if output_weight is None else output_weight
    return Head(_SwapSeqBatch.apply(hidden), weight)


class _SwapSeqBatch(torch.autograd.Function):
    """`x.transpose(0, 1).contiguous()` whose gradient is contiguous too.

    Autograd's own backward would hand a transposed view to every layer's backward (through the
    residual stream), and megatron's weight-gradient path copies each one contiguous again.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.transpose(0, 1).contiguous()


def set_mode(model: torch.nn.Module, *, training: bool) -> None:
    """`model.train(training)`, skipped when the model is in that mode already: the call walks
    every submodule (an MoE model has ~1000: 10 ms of host time per call on the H100's host,
    at the start of every step), and nothing here switches a submodule on its own."""
    if model.training != training:
        model.train(training)
