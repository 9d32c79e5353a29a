"""Parallel layouts' results, for `test_parallel.py`: under one torchrun launch, each layout in
turn (megatron's groups are set up anew for each); rank 0 saves them.

    python -m torch.distributed.run --nproc_per_node 2 tests/multirank.py MODEL OUTDIR \
        NAME:TP:PP[:flag,flag...[:MODEL]] ...   (a layout's own MODEL in place of the launch's)
        (flags: pack, distopt, sp, cp, split; overlap: overlapped grad reduce and param gather
        (with distopt); ep: EP2, etp: expert TP = TP, allgather: that
        token dispatcher; recompute / selrecompute: full / selective activation recompute;
        chunk: logits in chunks of CHUNK tokens; replay: router replay of the routes chosen on
        the first call; seqaux: a per-sequence load-balancing loss; invariant: batch_invariant;
        dyn: dynamic batching; bias: sigmoid routers' expert bias moved by BIAS_RATE a step)

Every rank gets its data-parallel shard of one fixed batch; rank 0 saves the results of the whole
batch (logprobs, top-k, reference logprobs, two GRPO steps' metrics, a step of each other loss
(full-vocabulary distillation included), logprobs after them, the
kinds of host reads rank 0 made inside a transformer layer's forward) to OUTDIR/NAME.pt and the
HF export to OUTDIR/NAME.hf.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from helpers import HostReads, make_batch

from policyworker.config import (
    DynamicBatchingConfig,
    GenerationConfig,
    MoEConfig,
    OptimizerConfig,
    ParallelConfig,
    PeftConfig,
    PolicyConfig,
    RecomputeConfig,
    SequencePackingConfig,
)
from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.data.contract import ROUTES
from policyworker.losses import (
    ClippedPGConfig,
    ClippedPGLoss,
    DistillationConfig,
    DistillationLoss,
    DPOLoss,
    FullDistillationConfig,
    FullDistillationLoss,
    Loss,
)
from policyworker.worker import MegatronPolicyWorker

BATCH, SEQ, TOPK = 8, 14, 5
# Under DP2 the first shard is long and the second short: packed, they need different numbers of
# bins, and the short rank runs fillers so that both run as many micro-batches.
LENGTHS = [14, 13, 14, 12, 3, 4, 2, 5]
PACK_TOKENS = 32
CHUNK = 5  # logprob_chunk_size: divides no micro-batch's tokens
NEW_TOKENS = 6  # generation.max_new_tokens
BIAS_RATE = 1e-2  # moe_router_bias_update_rate with "bias": large enough to change routes


def train(
    worker: MegatronPolicyWorker, data: BatchedDataDict, loss: Loss, mbs: int | None, split: bool
) -> dict[str, object]:
    """A train step, or (`split`) the same step streamed in two chunks of split-step training."""
    if not split or loss.normalizer is None:
        return worker.train(data, loss, mbs=mbs)
    worker.begin_train_step(loss, mbs=mbs)
    half = data.size // 2
    worker.train_microbatch(data.slice(0, half))
    worker.train_microbatch(data.slice(half, data.size))
    return worker.finish_train_step()


def layout_results(
    worker: MegatronPolicyWorker, data: BatchedDataDict, split: bool = False
) -> dict[str, object]:
    """What every layout must agree on, for this rank's `data`. Under router replay, the routes
    its routers chose on the first call, then every call and step replays them."""
    out: dict[str, object] = {}
    if worker.cfg.moe.router_replay:
        own = worker.get_logprobs(data=data, require_router_replay=False, return_routes=True)
        out["routes"] = own["routed_experts"]
        data = BatchedDataDict({**data, "routed_experts": own["routed_experts"]})
    out |= {"logprobs": worker.get_logprobs(data=data, micro_batch_size=1)["logprobs"]}
    topk = worker.get_topk_logits(data=data, k=TOPK)
    out["topk_logits"], out["topk_indices"] = topk["topk_logits"], topk["topk_indices"]
    out["reference_logprobs"] = worker.get_reference_policy_logprobs(data=data)[
        "reference_logprobs"
    ]
    out["train"] = [train(worker, data, ClippedPGLoss(), None, split) for _ in range(2)]
    # read right after the step (what a refit reads; with overlapped parameter gathers, no
    # forward has gathered them yet): per HF tensor, its float64 sum and sum of squares
    out["export_after_train"] = {
        name: (t.double().sum().item(), t.double().square().sum().item())
        for name, t in worker.export_hf_weights()
    }
    out["logprobs_after"] = worker.get_logprobs(data=data)["logprobs"]
    out["tp_attributes"] = worker.check_tensor_parallel_attributes()
    # the whole vocabulary's logits (last pipeline stage only: None on rank 0 under PP)
    out["teacher_full_payload"] = worker.get_logprobs_with_full_payload(
        data=data, payload="logits", payload_dtype="float32"
    )["teacher_full_payload"]
    if worker.shape.latent is None and worker.shape.delta_net is None:  # refused by name
        out["qkv_scales"] = worker.calibrate_qkv_fp8_scales(
            data=data, micro_batch_size=2, percentile=100.0, include_q=True
        )
    # One step of each other loss (their gradients show in grad_norm), in a fixed order: on the
    # dense layouts (a loss reads logprobs and logits, which the MoE layouts already check;
    # MoE adds its aux losses to every loss alike)
    if worker.shape.moe is None:
        out["train"] += [train(worker, data, loss, 2, split) for loss in OTHER_LOSSES]
    out["train"] += full_distillation_steps(worker, data, split)
    # the reference swapped in and out right after a step (with overlapped gathers: the live
    # weights it saves and restores must be whole)
    out["reference_after"] = worker.get_reference_policy_logprobs(data=data)["reference_logprobs"]
    # as the routers choose (transformers' logprobs of the export route on their own too)
    out["logprobs_final"] = worker.get_logprobs(data=data, require_router_replay=False)["logprobs"]
    out |= generated(worker, data)
    out |= odd_width(worker, data)
    return out


def odd_width(worker: MegatronPolicyWorker, data: BatchedDataDict) -> dict[str, torch.Tensor]:
    """The forward-only calls on the batch cut to an odd width, SEQ - 1, its longest rows that
    long: under TP2 with sequence parallelism a micro-batch runs one position wider than the
    batch (its width rounded up to a multiple of TP)."""
    width = SEQ - 1
    ids = data["input_ids"][:, :width]
    odd = BatchedDataDict(
        {"input_ids": ids, "input_lengths": data["input_lengths"].clamp(max=width)}
    )
    if ROUTES in data:
        odd[ROUTES] = data[ROUTES][:, :width]
    out = {
        "odd_logprobs": worker.get_logprobs(data=odd)["logprobs"],
        "odd_topk_logits": worker.get_topk_logits(data=odd, k=TOPK)["topk_logits"],
        "odd_reference": worker.get_reference_policy_logprobs(data=odd)["reference_logprobs"],
    }
    payload = worker.get_logprobs_with_full_payload(
        data=odd, payload="logits", payload_dtype="float32"
    )["teacher_full_payload"]
    return out | ({} if payload is None else {"odd_payload": payload})


def generated(worker: MegatronPolicyWorker, data: BatchedDataDict) -> dict[str, torch.Tensor]:
    """Greedy and sampled responses to the rows' first halves, padded to one width (a row's
    draws are keyed by its index in the whole batch: dp_rank x B + the row for this contiguous
    split, so every layout draws the one rank's samples)."""
    prompts = BatchedDataDict(
        {"input_ids": data["input_ids"], "input_lengths": (data["input_lengths"] + 1) // 2}
    )
    calls = {"greedy": {"greedy": True}, "sampled": {"seed": 11}}
    out = {}
    for name, kwargs in calls.items():
        got = worker.generate(data=prompts, **kwargs)
        pad = SEQ + NEW_TOKENS - got["output_ids"].shape[1]
        out[f"{name}_ids"] = torch.nn.functional.pad(got["output_ids"], (0, pad))  # pad id 0
        out[f"{name}_logprobs"] = torch.nn.functional.pad(got["logprobs"], (0, pad))
    return out


OTHER_LOSSES = (
    ClippedPGLoss(
        ClippedPGConfig(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="tis",
            truncated_importance_sampling_ratio=1.5,
            reference_policy_kl_penalty=0.1,
            positive_example_nll_weight=0.2,
        )
    ),
    DPOLoss(),
    DistillationLoss(DistillationConfig(kl_type="mixed", zero_outside_topk=True)),
)


def full_distillation_steps(
    worker: MegatronPolicyWorker, data: BatchedDataDict, split: bool
) -> list[dict[str, object]]:
    """A step of full-vocabulary distillation from the batch's random teacher hidden states
    (through the model's own LM head, loaded as the teacher's) and one from its random teacher
    logits; none for a batch without them or of another hidden size."""
    hidden = data.get("opd_hidden")
    if hidden is None or hidden.shape[-1] != worker.shape.hidden_size or worker.shape.moe:
        return []  # the loss reads the output head alone: the dense layouts cover it
    worker.load_opd_full_teacher_lm_head(worker.cfg.model_name, 0)
    steps = []
    for kind, key in (("hidden_states", "opd_hidden"), ("logits", "opd_logits")):
        batch = BatchedDataDict({**data, "teacher_full_payload": data[key]})
        loss = FullDistillationLoss(FullDistillationConfig(payload=kind))
        steps.append(train(worker, batch, loss, 2, split))
    return steps


def config(
    model: str,
    *,
    tp: int,
    pp: int,
    pack: bool = False,
    distopt: bool = False,
    overlap: bool = False,
    sp: bool = False,
    cp: int = 1,
    ep: int = 1,
    etp: int = 1,
    dispatcher: str = "alltoall",
    recompute: str | None = None,
    chunk: int | None = None,
    replay: bool = False,
    seq_aux: bool = False,
    invariant: bool = False,
    dynamic: bool = False,
    bias: bool = False,
    lora: bool = False,
) -> PolicyConfig:
    packing = SequencePackingConfig(
        enabled=pack, train_mb_tokens=PACK_TOKENS, logprob_mb_tokens=PACK_TOKENS
    )
    return PolicyConfig(
        model_name=model,
        precision="float32",
        train_global_batch_size=BATCH,
        train_micro_batch_size=1,
        logprob_batch_size=2,
        max_total_sequence_length=32,
        logprob_chunk_size=chunk,
        batch_invariant=invariant,
        optimizer=OptimizerConfig(
            lr=1e-3,
            use_distributed_optimizer=distopt,
            overlap_grad_reduce=overlap,
            overlap_param_gather=overlap,
        ),
        parallel=ParallelConfig(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            sequence_parallel=sp,
        ),
        sequence_packing=packing,
        dynamic_batching=DynamicBatchingConfig(
            enabled=dynamic, train_mb_tokens=PACK_TOKENS, logprob_mb_tokens=PACK_TOKENS
        ),
        generation=GenerationConfig(max_new_tokens=NEW_TOKENS),
        moe=MoEConfig(
            moe_token_dispatcher_type=dispatcher,
            router_replay=replay,
            moe_router_load_balancing_type="seq_aux_loss" if seq_aux else "none",
            moe_aux_loss_coeff=0.1 if seq_aux else 0.0,
            moe_router_bias_update_rate=BIAS_RATE if bias else 0.0,
        ),
        recompute=RecomputeConfig(
            activation_checkpointing=recompute is not None,
            recompute_granularity=recompute or "full",
            recompute_modules=["core_attn", "mlp", "moe"] if recompute == "selective" else None,
        ),
        # B drawn, not zero: the adapters change the outputs from the first step
        peft=PeftConfig(enabled=lora, dim=4, alpha=8, lora_B_init_method="normal"),
    )


def fixed_batch(vocab: int, hidden: int = 64) -> BatchedDataDict:
    """The batch, with a random teacher's full payloads: hidden states [B, S, hidden] and
    logits [B, S, vocab] (for `full_distillation_steps`)."""
    data = make_batch(batch=BATCH, seq=SEQ, vocab=vocab, seed=5, lengths=LENGTHS)
    g = torch.Generator().manual_seed(6)
    data["opd_hidden"] = torch.randn(BATCH, SEQ, hidden, generator=g)
    data["opd_logits"] = 3 * torch.randn(BATCH, SEQ, vocab, generator=g)
    return data


def run_layout(model: str, out: Path, tp: int, pp: int, flags: list[str]) -> None:
    worker = MegatronPolicyWorker(
        config(
            model,
            tp=tp,
            pp=pp,
            pack="pack" in flags,
            distopt="distopt" in flags,
            overlap="overlap" in flags,
            sp="sp" in flags,
            cp=2 if "cp" in flags else 1,
            ep=2 if "ep" in flags else 1,
            etp=tp if "etp" in flags else 1,
            dispatcher="allgather" if "allgather" in flags else "alltoall",
            recompute="full"
            if "recompute" in flags
            else "selective"
            if "selrecompute" in flags
            else None,
            chunk=CHUNK if "chunk" in flags else None,
            replay="replay" in flags,
            seq_aux="seqaux" in flags,
            invariant="invariant" in flags,
            dynamic="dyn" in flags,
            bias="bias" in flags,
        )
    )
    data = fixed_batch(worker.shape.vocab_size)
    shard = data.shard_by_batch_size(worker.dims.dp)[worker.groups.dp_rank]
    reads = HostReads(worker.state.model)  # in the layers' forwards: none (no device sync)
    with reads:
        mine = layout_results(worker, shard, split="split" in flags)
    # Data-parallel peers hold the other rows: gather them (in dp-rank order) on every rank.
    shards: list[dict[str, object]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(shards, {"dp_rank": worker.groups.dp_rank, **mine})
    by_dp = {s["dp_rank"]: s for s in shards}
    full = {
        k: torch.cat([by_dp[r][k] for r in sorted(by_dp)])  # type: ignore[misc]
        for k, v in mine.items()
        if isinstance(v, torch.Tensor)
    }
    full["train"] = [s["train"] for s in shards]
    full["tp_attributes"] = mine["tp_attributes"]  # rank 0's
    full["qkv_scales"] = mine.get("qkv_scales")  # every rank's is the same
    full["export_after_train"] = mine["export_after_train"]  # rank 0's stage
    worker.save_hf_pretrained(out.with_suffix(".hf"))  # collective
    full["dims"] = worker.dims
    full["host_reads_in_layers"] = sorted(set(reads.reads))
    if dist.get_rank() == 0:
        torch.save(full, out)
    worker.shutdown()


def between_runs() -> None:
    """After one run of a launch: the next sets up megatron's groups anew."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    gc.collect()


def main() -> None:
    launch_model, out = sys.argv[1], Path(sys.argv[2])
    for spec in sys.argv[3:]:
        name, tp, pp, *rest = spec.split(":", 4)
        flags = rest[0].split(",") if rest and rest[0] else []
        model = rest[1] if len(rest) > 1 else launch_model  # a layout's own model
        run_layout(model, out / f"{name}.pt", int(tp), int(pp), flags)
        between_runs()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
