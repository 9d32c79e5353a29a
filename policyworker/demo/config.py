"""The demo's options (`DemoConfig`) and its inputs from disk, checked before any work starts.

Kept apart from the run itself so that the command line can refuse bad input without loading
megatron-core.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from policyworker.config import PolicyConfig, SequencePackingConfig, finite, from_dict, to_dict
from policyworker.demo.resume import ResumePoint, resume_point
from policyworker.demo.task import (
    Example,
    char_tokenizer,
    load_jsonl,
    load_tokenizer,
    tiny_llama_config,
)
from policyworker.generation.engine import encode_prompt
from policyworker.losses.clipped_pg import ClippedPGConfig
from policyworker.model.hf_config import load_hf_config, model_shape
from policyworker.model.layout_checks import check_layout
from policyworker.model.weights import check_hf_folder
from policyworker.parallel.dims import ParallelDims

DEMO_SETS: dict[str, str] = {  # PolicyConfig fields the demo derives from its own options
    "model_name": "--model",
    "precision": "precision",
    "train_global_batch_size": "train_global_batch_size",
    "train_micro_batch_size": "micro_batch_size",
    "logprob_batch_size": "micro_batch_size",
    "max_total_sequence_length": "max_sequence_length",
    "sequence_packing": "sequence_packing",
    "temperature": "temperature",
    "seed": "seed",
}


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    """The demo run. Defaults are the built-in task's, calibrated for 2 CPU cores."""

    out: str = "runs/demo"
    """Output folder: metrics.jsonl, metrics.png, hf/ (final export)."""
    model: str | None = None
    """A HF checkpoint to train instead of the built-in tiny Llama."""
    data: str | None = None
    """JSONL of {"prompt", "answer"} pairs (required with `model`)."""
    seed: int = 0
    """Seed for data, sampling and the model."""
    sft_steps: int = 900
    """SFT warm-up steps (NLLLoss)."""
    sft_batch: int = 64
    """Sequences per SFT step."""
    sft_lr: float = 1e-3
    """SFT learning rate."""
    sft_wrong_fraction: float = 0.5
    """Fraction of SFT labels replaced by wrong answers (built-in task)."""
    grpo_steps: int = 40
    """GRPO steps."""
    prompts_per_step: int = 16
    """Prompts per GRPO step."""
    group_size: int = 8
    """Samples per prompt."""
    grpo_lr: float = 5e-4
    """GRPO learning rate."""
    train_global_batch_size: int | None = None
    """Rollouts per optimizer step (NeMo-RL's `policy.train_global_batch_size`): a GRPO step's
    prompts_per_step x group_size rollouts take that many / this optimizer steps; None: one."""
    normalize_rewards: bool = True
    """Divide each advantage by its prompt's reward standard deviation (+1e-6; a prompt whose
    samples all scored alike keeps r - baseline), as NeMo-RL's GRPO does."""
    leave_one_out_baseline: bool = False
    """Baseline (and std) of a sample from the other samples of its prompt only (RLOO)."""
    temperature: float = 1.0
    """Sampling temperature (the worker divides logits by it too)."""
    max_new_tokens: int = 4
    """Longest response; each row's is clamped to the context left after its prompt
    (`max_sequence_length`), so a recipe's `${policy.max_total_sequence_length}` runs."""
    micro_batch_size: int = 64
    """Micro-batch size for train and logprobs; a step with fewer rows per worker (SFT's
    `sft_batch`, GRPO's `prompts_per_step * group_size`, over `workers`) uses that many."""
    max_sequence_length: int = 256
    """Longest prompt + response (the worker's max_total_sequence_length)."""
    precision: Literal["float32", "bfloat16"] = "float32"
    """Worker precision."""
    sequence_packing: SequencePackingConfig = field(
        default_factory=lambda: SequencePackingConfig(enabled=True)
    )
    """How the worker cuts batches: packed into token budgets by default (the budgets default to
    micro_batch_size * max_sequence_length; set `sequence_packing.train_mb_tokens=...`), or
    padded micro-batches of micro_batch_size rows with `sequence_packing.enabled=false`."""
    loss: ClippedPGConfig = field(
        default_factory=lambda: ClippedPGConfig(reference_policy_kl_penalty=0.0)
    )
    """ClippedPGLoss options."""
    worker: dict[str, Any] = field(default_factory=dict)
    """Further `PolicyConfig` fields for the workers, e.g. `worker.max_grad_norm=0.5` or
    `worker.parallel.tensor_model_parallel_size=2` (a NeMo-RL recipe's policy section lands
    here); the fields the demo sets itself (`DEMO_SETS`) are refused."""
    engine: Literal["transformers", "megatron"] = "transformers"
    """Who samples the responses: our transformers engine in its own process, refitted from
    the workers over IPC every GRPO step, or the workers themselves (`Policy.generate`: the
    model that trains, a KV cache, no refit)."""
    refit: Literal["ipc", "sparse"] = "ipc"
    """How the transformers engine gets the weights before each GRPO step: every byte over
    IPC, or only the changed elements through the sparse-delta transport over TCP (rows add
    `refit_changed_fraction`, `refit_wire_bytes`, `refit_full_bytes`; with precision=bfloat16
    most elements of a small step do not change)."""
    workers: int = 1
    """Worker processes (data parallel), started and driven by `policyworker.Policy`."""
    backend: Literal["local", "ray"] = "local"
    """How the workers run: processes of this machine, or Ray actors (a local Ray cluster
    unless `RAY_ADDRESS` names one)."""
    save_every: int = 0
    """Save a checkpoint every this many steps (SFT and GRPO steps count alike) to
    `out/checkpoints/step_N/` (worker weights, optimizer state and the loop's own state); 0: never."""
    resume: str | None = None
    """A `out/checkpoints/step_N` folder to continue from: the run goes on at step N with the
    saved weights, optimizer, data order and sampler seed, and rewrites the rows before N.
    Without it, a run whose `out` holds complete steps continues from the latest
    (`policyworker.demo.resume`)."""

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, expected: str) -> None:
            if not ok:
                raise ValueError(f"{name}: expected {expected}, got {getattr(self, name)!r}")

        for name in ("sft_steps", "grpo_steps", "save_every"):
            check(getattr(self, name) >= 0, name, ">= 0")
        check(self.backend in ("local", "ray"), "backend", "'local' or 'ray'")
        check(self.engine in ("transformers", "megatron"), "engine", "'transformers' or 'megatron'")
        check(self.refit in ("ipc", "sparse"), "refit", "'ipc' or 'sparse'")
        check(
            self.refit == "ipc" or self.engine == "transformers",
            "refit",
            "'ipc' with engine=megatron (nothing to refit)",
        )
        for name in (
            "sft_batch",
            "prompts_per_step",
            "micro_batch_size",
            "max_new_tokens",
            "workers",
        ):
            check(getattr(self, name) >= 1, name, ">= 1")
        check(self.group_size >= 2, "group_size", ">= 2 (advantages compare samples of a prompt)")
        for name in ("sft_lr", "grpo_lr", "temperature"):
            check(finite(getattr(self, name)) and getattr(self, name) > 0, name, "a finite > 0")
        check(
            finite(self.sft_wrong_fraction) and 0 <= self.sft_wrong_fraction <= 1,
            "sft_wrong_fraction",
            "a fraction in [0, 1]",
        )
        check(0 <= self.seed < 2**32, "seed", "an int in [0, 2**32)")
        self.sequence_packing.validate("sequence_packing")  # ClippedPGConfig checks itself
        check(isinstance(self.worker, dict), "worker", "a mapping of PolicyConfig fields")
        for key in self.worker:
            if key in DEMO_SETS:
                raise ValueError(f"worker.{key}: set by the demo; use {DEMO_SETS[key]} instead")
        if isinstance(self.worker.get("optimizer"), dict) and "lr" in self.worker["optimizer"]:
            raise ValueError("worker.optimizer.lr: set by the demo; use sft_lr and grpo_lr")
        gen = self.worker.get("generation")
        if isinstance(gen, dict) and gen.get("max_new_tokens", self.max_new_tokens) != (
            self.max_new_tokens
        ):
            raise ValueError(
                "worker.generation.max_new_tokens: set by the demo; use max_new_tokens"
            )
        rollouts = self.prompts_per_step * self.group_size
        gbs = self.train_global_batch_size
        check(
            gbs is None or (isinstance(gbs, int) and gbs >= 1 and rollouts % gbs == 0),
            "train_global_batch_size",
            f"null or a divisor of the {rollouts} rollouts of a step (prompts_per_step x group_size)",
        )
        steps = {
            "prompts_per_step": gbs or rollouts,  # rows of an optimizer step
            "sft_batch": self.sft_batch,
        }
        for name, rows in steps.items():
            check(
                rows % self.workers == 0,
                name,
                f"rows per step a multiple of workers={self.workers}",
            )
            per_worker = rows // self.workers
            check(
                per_worker % self.step_mbs(rows) == 0,
                "micro_batch_size",
                f"a divisor of the {per_worker} rows per worker of a step ({name}), or more",
            )

    def step_mbs(self, rows: int) -> int:
        """The micro-batch size of a step of `rows` rows: `micro_batch_size`, at most the rows
        each worker gets (one rule for SFT and GRPO)."""
        return min(self.micro_batch_size, rows // self.workers)


@dataclass(slots=True)
class DemoInputs:
    """What a run reads from disk, loaded and checked before any work starts."""

    tokenizer: Any
    examples: list[Example] | None
    """The user's prompt/answer pairs; None for the built-in task."""
    model_dir: Path
    """The user's checkpoint, or where the built-in tiny Llama is saved (`out/init`)."""
    builtin_model: bool
    """Whether `model_dir` is the built-in model, written by the run."""
    policy: PolicyConfig
    """The workers' config."""
    resume: ResumePoint | None
    """Where the run continues from (None: a fresh run)."""


def policy_config(cfg: DemoConfig, model_dir: Path, experts: bool = False) -> PolicyConfig:
    """The workers' config: the demo's settings, `cfg.worker` over them (checked here, before
    any work). `experts`: the model has them (no `batch_invariant` then: not supported)."""
    rollouts = cfg.prompts_per_step * cfg.group_size
    gbs = cfg.train_global_batch_size or rollouts
    ours: dict[str, Any] = {
        "model_name": str(model_dir),
        "precision": cfg.precision,
        "train_global_batch_size": gbs,
        "train_micro_batch_size": cfg.step_mbs(gbs),
        "logprob_batch_size": cfg.step_mbs(rollouts),
        "max_total_sequence_length": cfg.max_sequence_length,
        "sequence_packing": to_dict(cfg.sequence_packing),
        "temperature": cfg.temperature,
        "seed": cfg.seed,
    }
    if cfg.engine == "megatron" and not experts and "batch_invariant" not in cfg.worker:
        ours["batch_invariant"] = True  # the workers' generation logprobs are their scores
    ours["generation"] = {**cfg.worker.get("generation", {}), "max_new_tokens": cfg.max_new_tokens}
    optimizer = {"weight_decay": 0.0, "betas": [0.9, 0.99], **cfg.worker.get("optimizer", {})}
    ours["optimizer"] = {**optimizer, "lr": cfg.sft_lr}
    return from_dict(PolicyConfig, {**cfg.worker, **ours}, prefix="worker.")


def load_inputs(cfg: DemoConfig) -> DemoInputs:
    """Check the model folder, its tokenizer, the JSONL rows, the workers' config and where the
    run continues from; a `ValueError` names the option."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {cfg.out} exists and is not a folder")
    if cfg.model is None:
        if cfg.data is not None:
            raise ValueError("--data: needs --model (the built-in task has its own data)")
        tokenizer = char_tokenizer()
        shape = model_shape(tiny_llama_config(len(tokenizer)))
        examples, model_dir = None, out / "init"
    else:
        tokenizer, examples, shape = _user_task(cfg)
        model_dir = Path(cfg.model)
    policy = policy_config(cfg, model_dir, experts=shape.moe is not None)
    # the layout against this model and the workers, now: not in a traceback once work started
    check_layout(policy.parallel, shape, policy.moe, policy.recompute)
    p = policy.parallel
    ParallelDims.from_world(
        world_size=cfg.workers, tp=p.tensor_model_parallel_size,
        pp=p.pipeline_model_parallel_size, cp=p.context_parallel_size,
        ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size,
        sp=p.sequence_parallel, world_field="workers",
    )  # fmt: skip
    return DemoInputs(
        tokenizer=tokenizer,
        examples=examples,
        model_dir=model_dir,
        builtin_model=cfg.model is None,
        policy=policy,
        resume=resume_point(out, cfg.resume, shape),
    )


def _user_task(cfg: DemoConfig) -> tuple[Any, list[Example], Any]:
    """The user's tokenizer, rows and model shape, after checking the weights are whole and
    fit config.json."""
    if cfg.data is None:
        raise ValueError("--data: required with --model (a JSONL of prompt/answer pairs)")
    hf_config = load_hf_config(cfg.model, field="--model")
    shape = model_shape(hf_config)
    check_hf_folder(cfg.model, hf_config, shape, field="--model")
    tokenizer = load_tokenizer(cfg.model)
    if len(tokenizer) > shape.vocab_size:
        raise ValueError(
            f"--model: the tokenizer has {len(tokenizer)} tokens, the model {shape.vocab_size}"
        )
    examples = load_jsonl(cfg.data)
    for i, ex in enumerate(examples, start=1):
        prompt = len(encode_prompt(tokenizer, ex.prompt))
        answer = len(tokenizer(ex.answer, add_special_tokens=False)["input_ids"]) + 1
        if prompt + answer > cfg.max_sequence_length:  # its SFT row; samples are clamped
            raise ValueError(
                f"--data: row {i} needs {prompt} prompt + {answer} answer tokens, over "
                f"max_sequence_length={cfg.max_sequence_length}"
            )
    return tokenizer, examples, shape
