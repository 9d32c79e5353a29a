"""What a model can be run as, checked before anything is built: the parallel layout it splits
into (`check_layout`, naming the config field) and the sequence lengths it supports
(`check_sliding_window`)."""

from __future__ import annotations

from typing import Any

from policyworker.config import MoEConfig, ParallelConfig, PeftConfig, RecomputeConfig
from policyworker.model.errors import UnsupportedModelError
from policyworker.model.hf_config import GPT_OSS, ModelShape


def check_sliding_window(hf_config: Any, max_seq_len: int) -> None:
    """Sliding windows are read from `layer_types` for gpt-oss only (`ModelShape.windows`);
    another family's window is refused where sequences would need it."""
    if GPT_OSS in (getattr(hf_config, "architectures", None) or []):
        return
    window = getattr(hf_config, "sliding_window", None)
    enabled = getattr(hf_config, "use_sliding_window", True)
    if window is not None and enabled and window < max_seq_len:
        raise UnsupportedModelError(
            f"sliding_window={window} is smaller than max_total_sequence_length={max_seq_len}; "
            "sliding-window attention is not supported"
        )


def check_layout(
    parallel: ParallelConfig,
    shape: ModelShape,
    moe: MoEConfig | None = None,
    recompute: RecomputeConfig | None = None,
) -> None:
    """Refuse a layout this model cannot be split into, naming the config field.

    TP splits the heads, query groups and ffn (the vocabulary is padded to a multiple of TP);
    PP the layers; EP the experts and ETP each expert's ffn. Full recompute's layer count fits
    in a pipeline stage.
    """
    field = "parallel.{}_size".format
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    _check_experts(parallel, shape, moe or MoEConfig())
    if parallel.sequence_parallel and tp == 1:
        raise ValueError("parallel.sequence_parallel: needs tensor_model_parallel_size > 1")
    if shape.moe is not None and tp > 1 and not parallel.sequence_parallel:
        raise ValueError(  # megatron-core refuses MoE with TP alone
            "parallel.sequence_parallel: expected true for an MoE model with "
            f"tensor_model_parallel_size={tp}"
        )
    tp_split = {
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "intermediate_size": shape.ffn_hidden_size,
    }
    if shape.delta_net is not None:
        tp_split["linear_num_key_heads"] = shape.delta_net.key_heads
    if shape.moe is not None:
        tp_split["moe_intermediate_size"] = shape.moe.expert_ffn_size
        tp_split["shared_expert_intermediate_size"] = shape.moe.shared_expert_ffn_size
    for name, size in tp_split.items():
        if size % tp:
            raise ValueError(
                f"{field('tensor_model_parallel')}: expected a divisor of {name}={size}, got {tp}"
            )
    if shape.num_layers % pp:
        raise ValueError(
            f"{field('pipeline_model_parallel')}: expected a divisor of "
            f"num_layers={shape.num_layers}, got {pp}"
        )
    r, per_stage = recompute or RecomputeConfig(), shape.num_layers // pp
    full = r.activation_checkpointing and r.recompute_granularity == "full"
    if full and r.recompute_num_layers > per_stage:
        raise ValueError(
            f"recompute.recompute_num_layers: expected at most the {per_stage} layers of a "
            f"pipeline stage, got {r.recompute_num_layers}"
        )


def _check_experts(parallel: ParallelConfig, shape: ModelShape, moe: MoEConfig) -> None:
    field = "parallel.{}_size".format
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    if shape.moe is None:
        for name, size in (("expert_model_parallel", ep), ("expert_tensor_parallel", etp)):
            if size != 1:
                raise ValueError(f"{field(name)}: expected 1 (a dense model), got {size}")
        if moe.router_replay:
            raise ValueError("moe.router_replay: expected false (a dense model has no routers)")
        return
    if shape.moe.num_experts % ep:
        raise ValueError(
            f"{field('expert_model_parallel')}: expected a divisor of "
            f"num_experts={shape.moe.num_experts}, got {ep}"
        )
    # megatron adds an expert's fc2 bias on each expert-TP rank before their partial sums meet:
    # not built here
    if etp > 1 and shape.arch.linear_bias:
        raise ValueError(
            f"{field('expert_tensor_parallel')}: expected 1 for experts with biases, got {etp}"
        )
    if shape.moe.expert_ffn_size % etp:
        raise ValueError(
            f"{field('expert_tensor_parallel')}: expected a divisor of the experts' "
            f"intermediate size {shape.moe.expert_ffn_size}, got {etp}"
        )
    if moe.moe_token_dispatcher_type == "allgather":
        # It all-gathers equal shares of tokens; micro-batches are trimmed to their own longest
        # row, so pipeline stages and EP ranks (other data) see different lengths.
        for name, size in (("pipeline_model_parallel", parallel.pipeline_model_parallel_size),
                           ("expert_model_parallel", ep)):  # fmt: skip
            if size > 1:
                raise ValueError(
                    f"moe.moe_token_dispatcher_type: expected alltoall with {field(name)}="
                    f"{size}, got allgather"
                )


def check_peft(peft: PeftConfig, parallel: ParallelConfig, shape: ModelShape) -> None:
    """Refuse what LoRA does not build yet, naming the field (issue #55)."""
    if not peft.enabled:
        return
    tp = parallel.tensor_model_parallel_size
    if tp > 1:
        raise ValueError(
            f"parallel.tensor_model_parallel_size: expected 1 with peft.enabled (LoRA under "
            f"tensor parallelism is not supported yet), got {tp}"
        )
    if shape.moe is not None:
        raise ValueError(
            "peft.enabled: not supported yet for mixture-of-experts models (the experts' "
            "adapters are not built)"
        )
