"""Hugging Face config -> what megatron needs: the architecture table and the model's shape.

One row per supported `architectures[0]`. Adding a dense decoder is a row here plus, if its
weight names differ, a row in `weights.py`; a mixture-of-experts decoder also reads its experts'
dimensions in `_moe_shape`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from policyworker.model.errors import UnsupportedModelError
from policyworker.model.rope_scaling import rope_parameters, rope_type, softmax_mscale
from policyworker.model.router_rules import RouterRule, Sigmoid, Softmax
from policyworker.ops.packed import round_up


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """Architecture features that change the megatron model or the weight layout."""

    qkv_bias: bool
    """Whether q/k/v projections carry a bias."""
    qk_norm: bool
    """Whether queries and keys are RMS-normalized per head before RoPE (Qwen3)."""
    linear_bias: bool = False
    """Biases on every linear layer: q/k/v, o, the router and the experts (gpt-oss)."""
    output_gate: bool = False
    """Attention's output times sigmoid of a gate its q_proj also makes (Qwen3.5)."""
    zero_centered_norm: bool = False
    """Norm weights stored as offsets from 1: x · (1 + w) (Qwen3.5)."""


ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(qkv_bias=False, qk_norm=False),
    "MistralForCausalLM": ArchSpec(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": ArchSpec(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": ArchSpec(qkv_bias=False, qk_norm=True),
    # mixture of experts
    "MixtralForCausalLM": ArchSpec(qkv_bias=False, qk_norm=False),
    "Qwen2MoeForCausalLM": ArchSpec(qkv_bias=True, qk_norm=False),
    "Qwen3MoeForCausalLM": ArchSpec(qkv_bias=False, qk_norm=True),
    # its config says whether q/k/v have biases (attention_bias) and q/k norms (use_qk_norm)
    "Glm4MoeForCausalLM": ArchSpec(qkv_bias=False, qk_norm=False),
    # multi-head latent attention (`LatentShape`), GLM-4.5's routing
    "DeepseekV3ForCausalLM": ArchSpec(qkv_bias=False, qk_norm=False),
    # attention sinks, sliding-window layers, the clamped SwiGLU, fused experts on disk
    "GptOssForCausalLM": ArchSpec(qkv_bias=True, qk_norm=False, linear_bias=True),
    # Gated DeltaNet layers beside gated full attention (`DeltaNetShape`)
    "Qwen3_5ForCausalLM": ArchSpec(
        qkv_bias=False, qk_norm=True, output_gate=True, zero_centered_norm=True
    ),
    # the same layers, every MLP Qwen2-MoE's experts (renormalized top-k, a gated shared expert)
    "Qwen3_5MoeForCausalLM": ArchSpec(
        qkv_bias=False, qk_norm=True, output_gate=True, zero_centered_norm=True
    ),
    # Qwen3.5-MoE's layers, the linear layers' in-projections fused per key head on disk
    "Qwen3NextForCausalLM": ArchSpec(
        qkv_bias=False, qk_norm=True, output_gate=True, zero_centered_norm=True
    ),
}
CONFIGURED_ATTENTION = {"Glm4MoeForCausalLM"}
"""Architectures whose `attention_bias` puts biases on q/k/v only (not on o_proj) and whose
`use_qk_norm` adds per-head q/k norms."""

NOT_YET: dict[str, str] = {}
"""Architectures RL teams ask for, refused by name until they land."""
VISION_LANGUAGE = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}
"""Vision-language checkpoints whose language model we train (the vision tower is not read), as
the causal LM of their `text_config` (what transformers' AutoModelForCausalLM builds from them)."""
GPT_OSS = "GptOssForCausalLM"
QWEN3_NEXT = "Qwen3NextForCausalLM"
HYBRID = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", QWEN3_NEXT)
"""Qwen3.5's text models and Qwen3-Next: Gated DeltaNet layers (`DeltaNetShape`)."""
GPT_OSS_SWIGLU_LIMIT = 7.0
"""gpt-oss's SwiGLU clamp, a constant in transformers' `GptOssExperts` (its alpha, 1.702, is
megatron's `quick_gelu`'s)."""


@dataclass(frozen=True, slots=True)
class MoEShape:
    """The experts of a mixture-of-experts decoder (every MoE layer alike)."""

    num_experts: int
    top_k: int
    """Experts per token."""
    expert_ffn_size: int
    """Each expert's intermediate size."""
    rule: RouterRule
    """How the router picks and weighs the top k (`model/router_rules.py`)."""
    layers: tuple[bool, ...]
    """Per layer: an MoE layer (True) or a dense MLP of `ffn_hidden_size` (False)."""
    shared_expert_ffn_size: int = 0
    """A shared expert beside the routed ones; 0: none."""
    shared_expert_gate: bool = False
    """The shared expert's output scaled by a sigmoid gate (Qwen2-MoE; DeepSeek/GLM: none)."""


@dataclass(frozen=True, slots=True)
class LatentShape:
    """Multi-head latent attention (DeepSeek-V3): queries through a rank-`q_lora_rank` bottleneck
    with its norm (0: one projection, no norm: Moonlight, DeepSeek-V2-Lite), keys and values from a rank-`kv_lora_rank` latent plus one RoPE key
    shared by the heads; a head's query/key is `nope_dim` features without RoPE, then `rope_dim`
    with; its value `v_dim`."""

    q_lora_rank: int
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    interleaved: bool
    """HF's `rope_interleave`: the checkpoint's RoPE features are in interleaved pairs, as
    megatron's MLA reads them (false: halves, permuted on load and back on export)."""
    mscale: tuple[float, float] = (1.0, 0.0)
    """YaRN's (factor, mscale_all_dim), which scale the softmax (`rope_scaling.softmax_mscale`)."""


@dataclass(frozen=True, slots=True)
class DeltaNetShape:
    """A Gated DeltaNet layer's dimensions (`linear_*` of the HF config: Qwen3.5, Qwen3-Next)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    grouped_on_disk: bool = False
    """HF's in-projections fused per key head (Qwen3-Next's in_proj_qkvz and in_proj_ba), not
    one tensor per part (Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)."""

    @property
    def conv_blocks(self) -> tuple[int, int, int]:
        """The channels of q, k and v, which the causal conv runs over."""
        keys = self.key_heads * self.key_dim
        return keys, keys, self.value_heads * self.value_dim

    @property
    def in_blocks(self) -> tuple[int, ...]:
        """The fused in-projection's outputs: q, k, v, then z (the gate, one per value
        channel), b and a (one per value head)."""
        return (*self.conv_blocks, self.value_heads * self.value_dim, *(self.value_heads,) * 2)

    def split(self, tp: int) -> DeltaNetShape:
        """One TP rank's share: its key heads and the value heads that read them."""
        return replace(self, key_heads=self.key_heads // tp, value_heads=self.value_heads // tp)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The dimensions of a dense decoder, read once from the HF config."""

    architecture: str
    arch: ArchSpec
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    moe: MoEShape | None = None
    """The experts, for a mixture-of-experts decoder."""
    rotary_dim: int = 0
    """The features of each head that RoPE rotates, from `rotary_offset` (0: all of
    `head_dim`; GLM-4.5's `partial_rotary_factor` rotates the first half, MLA the last
    `rope_dim`); the rest pass through."""
    rotary_offset: int = 0
    latent: LatentShape | None = None
    """Multi-head latent attention's dimensions (None: standard attention)."""
    windows: tuple[int, ...] = ()
    """Per layer, the sliding window a query reaches (itself and the `window - 1` keys before
    it; 0: every key before it), from `layer_types` (gpt-oss); empty: every layer full."""
    sinks: bool = False
    """A learned per-head logit in every query's softmax denominator (gpt-oss's `sinks`)."""
    swiglu_clamp: float = 0.0
    """gpt-oss's SwiGLU (0: plain silu(gate) * up): gate and up clamped to this limit,
    gate * sigmoid(1.702 gate) * (up + 1)."""
    delta_net: DeltaNetShape | None = None
    """The linear-attention layers' dimensions (Qwen3.5); None: none."""
    linear_layers: tuple[bool, ...] = ()
    """Per layer: a Gated DeltaNet layer (True) or full attention (False); empty: none."""

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def padded_vocab_size(self, tp: int) -> int:
        """The vocabulary rounded up to a multiple of TP: megatron's embedding and output layer
        have this many rows; the rows past `vocab_size` are zero and never count."""
        return round_up(self.vocab_size, tp)


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def load_hf_config(
    folder: str | Path, *, field: str = "model_name", require_weights: bool = True
) -> Any:
    """The `PretrainedConfig` of a local HF checkpoint folder, after checking the folder has a
    config and safetensors weights. Never reaches for the hub: a bad path is a `ValueError`
    naming `field`, not a repo-id error."""
    path = Path(folder)
    if not path.is_dir():
        raise ValueError(f"{field}: {folder} is not a folder (expected a Hugging Face checkpoint)")
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{field}: {folder} has no config.json (expected a Hugging Face checkpoint)"
        )
    if require_weights and not any((path / name).is_file() for name in WEIGHT_FILES):
        raise ValueError(f"{field}: {folder} has no {' or '.join(WEIGHT_FILES)}")
    from transformers import AutoConfig

    try:
        return language_model(AutoConfig.from_pretrained(path, local_files_only=True))
    except (OSError, ValueError, KeyError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{field}: {folder}/config.json does not load ({reason})") from None


def language_model(hf_config: Any) -> Any:
    """The config of the model we train: a vision-language checkpoint's `text_config` as its
    causal LM (`VISION_LANGUAGE`; the checkpoint's top-level `tie_word_embeddings` kept); any
    other config as it is. Its weights are read from under `model.language_model.`
    (`weights.SafetensorsReader`) and exported as that causal LM's."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs or archs[0] not in VISION_LANGUAGE:
        return hf_config
    text = copy.deepcopy(hf_config.text_config)
    text.architectures = [VISION_LANGUAGE[archs[0]]]
    text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
    return text


def model_shape(hf_config: Any) -> ModelShape:
    """Validate an HF config and read its dimensions. Raises `UnsupportedModelError`."""
    hf_config = language_model(hf_config)
    archs = list(getattr(hf_config, "architectures", None) or [])
    name = archs[0] if archs else ""
    if name in NOT_YET:
        raise UnsupportedModelError(f"{name}: {NOT_YET[name]} is not supported yet")
    if name not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"model architecture {name or '(none)'!r} is not supported; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    if getattr(hf_config, "quantization_config", None):
        method = dict(hf_config.quantization_config).get("quant_method", "?")
        raise UnsupportedModelError(
            f"quantization_config (quant_method={method!r}): quantized checkpoints are not "
            "supported; load a bf16/fp32 checkpoint (e.g. dequantized by transformers)"
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(
            f"hidden_act {hf_config.hidden_act!r}: only 'silu' is supported"
        )
    if getattr(hf_config, "mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=True is not supported")
    # Llama/Qwen3's attention_bias also puts a bias on o_proj, which megatron only offers
    # together with biases on every MLP linear.
    biased = name in CONFIGURED_ATTENTION or ARCHITECTURES[name].linear_bias
    if getattr(hf_config, "attention_bias", False) and not biased:
        raise UnsupportedModelError(f"{name} with attention_bias=True is not supported")
    rope_type(hf_config)  # refused here by name unless supported
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    rotary_dim = int(head_dim * partial_rotary_factor(hf_config))
    latent = _latent_shape(hf_config) if name == "DeepseekV3ForCausalLM" else None
    offset = 0
    if latent is not None:  # every head has its own keys; RoPE on the last rope_dim features
        kv_heads, head_dim = heads, latent.nope_dim + latent.rope_dim
        offset, rotary_dim = latent.nope_dim, latent.rope_dim
    return ModelShape(
        architecture=name,
        arch=_arch(name, hf_config),
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=getattr(hf_config, "intermediate_size", None) or 0,  # 0: no dense MLP
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=hf_config.vocab_size,
        rms_norm_eps=hf_config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        max_position_embeddings=hf_config.max_position_embeddings,
        moe=_moe_shape(name, hf_config),
        rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
        rotary_offset=offset,
        latent=latent,
        **(_gpt_oss_fields(hf_config) if name == GPT_OSS else {}),
        **(_delta_net_fields(hf_config, name) if name in HYBRID else {}),
    )


def _delta_net_fields(hf_config: Any, name: str) -> dict[str, Any]:
    """The hybrid pattern and the linear layers' dimensions."""
    shape = DeltaNetShape(
        key_heads=hf_config.linear_num_key_heads,
        value_heads=hf_config.linear_num_value_heads,
        key_dim=hf_config.linear_key_head_dim,
        value_dim=hf_config.linear_value_head_dim,
        conv_kernel=hf_config.linear_conv_kernel_dim,
        grouped_on_disk=name == QWEN3_NEXT,
    )
    if shape.value_heads % shape.key_heads:
        raise UnsupportedModelError(
            f"linear_num_value_heads={shape.value_heads}: expected a multiple of "
            f"linear_num_key_heads={shape.key_heads}"
        )
    kinds = {"linear_attention": True, "full_attention": False}
    return dict(delta_net=shape, linear_layers=_per_layer(hf_config, kinds))


def _per_layer[T](hf_config: Any, kinds: dict[str, T]) -> tuple[T, ...]:
    """Each layer's entry of `kinds` by its `layer_types`; another kind is refused by name."""
    unknown = sorted(set(hf_config.layer_types) - set(kinds))
    if unknown:
        raise UnsupportedModelError(f"layer_types {unknown}: not supported")
    return tuple(kinds[k] for k in hf_config.layer_types)


def _gpt_oss_fields(hf_config: Any) -> dict[str, Any]:
    """gpt-oss's sinks, per-layer windows and clamped SwiGLU."""
    if not hf_config.attention_bias:  # megatron's biases come on every linear layer or none
        raise UnsupportedModelError("gpt-oss with attention_bias=False is not supported")
    limit = getattr(hf_config, "swiglu_limit", GPT_OSS_SWIGLU_LIMIT)
    if limit != GPT_OSS_SWIGLU_LIMIT:  # transformers ignores it (its experts hard-code 7.0)
        raise UnsupportedModelError(
            f"swiglu_limit={limit}: only {GPT_OSS_SWIGLU_LIMIT} (what transformers runs) is "
            "supported"
        )
    kinds = {"sliding_attention": hf_config.sliding_window or 0, "full_attention": 0}
    return dict(
        windows=_per_layer(hf_config, kinds),
        sinks=True,
        swiglu_clamp=GPT_OSS_SWIGLU_LIMIT,
    )


def _latent_shape(hf_config: Any) -> LatentShape:
    if getattr(hf_config, "attention_bias", False):
        raise UnsupportedModelError("DeepSeek-V3 with attention_bias=True is not supported")
    return LatentShape(
        q_lora_rank=hf_config.q_lora_rank or 0,
        kv_lora_rank=hf_config.kv_lora_rank,
        nope_dim=hf_config.qk_nope_head_dim,
        rope_dim=hf_config.qk_rope_head_dim,
        v_dim=hf_config.v_head_dim,
        interleaved=bool(getattr(hf_config, "rope_interleave", True)),
        mscale=softmax_mscale(hf_config),
    )


def _arch(name: str, hf_config: Any) -> ArchSpec:
    if name not in CONFIGURED_ATTENTION:
        return ARCHITECTURES[name]
    return ArchSpec(
        qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
        qk_norm=bool(getattr(hf_config, "use_qk_norm", False)),
    )


def partial_rotary_factor(hf_config: Any) -> float:
    """The share of each head RoPE rotates (transformers 5 keeps it in `rope_parameters`)."""
    factor = rope_parameters(hf_config).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(hf_config, "partial_rotary_factor", None)
    factor = float(factor or 1.0)
    if not 0 < factor <= 1:
        raise UnsupportedModelError(f"partial_rotary_factor={factor}: expected one in (0, 1]")
    return factor


def _moe_shape(name: str, hf_config: Any) -> MoEShape | None:
    """The experts of an MoE config (None for a dense decoder)."""
    layers = hf_config.num_hidden_layers
    if name in ("MixtralForCausalLM", GPT_OSS):  # every layer; the top k's logits softmaxed
        if getattr(hf_config, "router_jitter_noise", 0.0):
            raise UnsupportedModelError("router_jitter_noise > 0 is not supported")
        return MoEShape(
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            expert_ffn_size=hf_config.intermediate_size,
            rule=Softmax(normalize=True),
            layers=(True,) * layers,
        )
    if name in ("Glm4MoeForCausalLM", "DeepseekV3ForCausalLM"):
        return _sigmoid_moe_shape(hf_config)
    if name not in (
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen3_5MoeForCausalLM",
        QWEN3_NEXT,
    ):
        return None
    # Qwen3.5-MoE: every layer, the top k always renormalized (no such keys in its config)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1)
    experts = hf_config.num_experts
    shared = getattr(hf_config, "shared_expert_intermediate_size", 0) or 0
    return MoEShape(
        num_experts=experts,
        top_k=hf_config.num_experts_per_tok,
        expert_ffn_size=hf_config.moe_intermediate_size,
        rule=Softmax(normalize=bool(getattr(hf_config, "norm_topk_prob", True))),
        layers=tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers)),
        shared_expert_ffn_size=shared,
        shared_expert_gate=shared > 0,
    )


def _sigmoid_moe_shape(hf_config: Any) -> MoEShape:
    """DeepSeek-style experts (DeepSeek-V3, GLM-4.5): sigmoid routing with the expert bias, group-limited,
    scaled; ungated shared experts; the first `first_k_dense_replace` layers dense."""
    if not hf_config.norm_topk_prob:  # megatron renormalizes sigmoid weights always
        raise UnsupportedModelError("norm_topk_prob=False with sigmoid routing is not supported")
    experts, groups = hf_config.n_routed_experts, hf_config.n_group or 1
    if experts % groups or not 1 <= hf_config.topk_group <= groups:
        raise UnsupportedModelError(
            f"n_group={groups}, topk_group={hf_config.topk_group}: expected n_group to divide "
            f"n_routed_experts={experts} and 1 <= topk_group <= n_group"
        )
    rule = Sigmoid(groups, hf_config.topk_group, float(hf_config.routed_scaling_factor))
    dense = hf_config.first_k_dense_replace
    return MoEShape(
        num_experts=experts,
        top_k=hf_config.num_experts_per_tok,
        expert_ffn_size=hf_config.moe_intermediate_size,
        rule=rule,
        layers=tuple(i >= dense for i in range(hf_config.num_hidden_layers)),
        shared_expert_ffn_size=hf_config.moe_intermediate_size * (hf_config.n_shared_experts or 0),
    )
