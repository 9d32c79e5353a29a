"""The main job: SFT warm-up, then GRPO, with a group of workers (`Policy`) and a sampler in its
own process.

    python -m policyworker demo --out runs/demo                    # built-in addition task, CPU
    python -m policyworker demo --model /ckpt --data tasks.jsonl   # your checkpoint (GPU)

One GRPO step, as a colocated RL loop runs it (trainer and sampler share the device):
`offload_before_refit`, refit the sampler, `offload_after_refit`; sample a group of responses
per prompt, reward them, normalize rewards within each group into advantages;
`prepare_for_lp_inference`, prev/reference logprobs from the worker; `prepare_for_training`,
train with ClippedPGLoss. On a GPU each phase logs a memory line.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.demo.config import DemoConfig, DemoInputs, load_inputs
from policyworker.demo.refits import IpcRefit, SparseRefit
from policyworker.demo.resume import step_folder
from policyworker.demo.task import (
    Example,
    addition_examples,
    noisy_labels,
    reward,
    tiny_llama_config,
)
from policyworker.driver.policy import Policy
from policyworker.generation.engine import Samples, encode_prompt
from policyworker.generation.process import GenerationProcess
from policyworker.losses import ClippedPGLoss, NLLLoss
from policyworker.refit.sparse import KEY_ENV, fresh_key_env

log = logging.getLogger(__name__)


def tiny_llama(folder: Path, vocab_size: int, seed: int) -> Path:
    """A 0.6M-parameter random Llama, saved as a HF checkpoint."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(tiny_llama_config(vocab_size)).save_pretrained(folder)
    return folder


def sequences_batch(
    prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int
) -> BatchedDataDict:
    """Right-padded prompt+response; token_mask covers the response."""
    rows = [p + r for p, r in zip(prompt_ids, response_ids, strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    token_mask = torch.zeros(len(rows), width)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        token_mask[i, len(p) : len(p) + len(r)] = 1.0
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=torch.tensor([len(r) for r in rows]),
        token_mask=token_mask,
        sample_mask=torch.ones(len(rows)),
    )


def group_advantages(
    rewards: list[float], group_size: int, *, leave_one_out: bool = False, normalize: bool = True
) -> list[float]:
    """NeMo-RL's GRPO advantages within each group of samples of one prompt: r - baseline, the
    baseline the group's mean (`leave_one_out`: the mean of the other samples); `normalize`
    divides by the sample std (of the others, with `leave_one_out`) + 1e-6 where it is > 0."""
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1 :] if leave_one_out else group
            baseline = statistics.fmean(others)
            std = statistics.stdev(others) if len(others) > 1 else 0.0
            out.append((r - baseline) / (std + 1e-6) if normalize and std > 0 else r - baseline)
    return out


def grpo_batch(samples: Samples, advantages: list[float], pad_id: int) -> BatchedDataDict:
    """The GRPO batch contract from samples: advantages and generation logprobs on the response."""
    batch = sequences_batch(samples.prompt_ids, samples.response_ids, pad_id)
    adv = torch.tensor(advantages)
    batch["advantages"] = adv[:, None] * batch["token_mask"]
    gen = torch.zeros_like(batch["token_mask"])
    for i, (p, lp) in enumerate(zip(samples.prompt_ids, samples.response_logprobs, strict=True)):
        gen[i, len(p) : len(p) + len(lp)] = torch.tensor(lp)
    batch["generation_logprobs"] = gen
    return batch


class Run:
    """The demo's state: the workers (a `Policy`), sampler, task, metrics sink."""

    def __init__(self, cfg: DemoConfig, inputs: DemoInputs) -> None:
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(cfg.seed)
        self.tokenizer = inputs.tokenizer
        self.examples = inputs.examples
        model_dir = inputs.model_dir
        if inputs.builtin_model:  # the same weights for the same seed, resumed or not
            tiny_llama(model_dir, len(self.tokenizer), cfg.seed)
            self.tokenizer.save_pretrained(model_dir)
        resume = inputs.resume
        if torch.cuda.is_available():  # a memory line per phase (DEBUG level), in every worker
            logging.getLogger("policyworker.memory.telemetry").setLevel(logging.DEBUG)
        sparse = cfg.engine == "transformers" and cfg.refit == "sparse"
        key_env = fresh_key_env() if sparse else {}  # the run's key for signed sparse refits
        self.policy = Policy(
            inputs.policy,
            num_workers=cfg.workers,
            backend=cfg.backend,
            env=key_env,
            tokenizer=self.tokenizer,
            weights_path=None if resume is None else str(resume.folder / "weights"),
            optimizer_path=None if resume is None else str(resume.folder / "optim"),
        )
        self.start_step = 0
        if resume is not None:  # the loop's own state: data order, rows so far
            self.start_step = resume.loop["step"]
            self.rng.setstate(_rng_state(resume.loop["rng"]))
        # The sampler: a transformers engine in its own process, refitted before every GRPO
        # step (over IPC, or sparse deltas over TCP); or none (engine=megatron: the workers).
        self.sampler, self.refit = None, None
        if cfg.engine == "transformers":
            self.sampler = GenerationProcess(
                str(model_dir),
                self.policy.prepare_refit_info(),
                tokenizer=self.tokenizer,
                device=str(self.policy.device),
            )
            if sparse:
                self.refit = SparseRefit(self.policy, self.sampler, key_env[KEY_ENV])
            else:
                self.refit = IpcRefit(self.policy, self.sampler)
        # Rewritten whole: the rows before the resumed step come from its loop state.
        self.metrics_file = (self.out / "metrics.jsonl").open("w")
        self.history: list[dict] = []
        for row in [] if resume is None else resume.loop["rows"]:
            self.record(row)

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
        self.policy.shutdown()
        self.metrics_file.close()

    def save(self, steps_done: int) -> None:
        """`out/checkpoints/step_N/`: the worker's weights and optimizer, then `loop.json` (the
        step, the data RNG and the rows so far), written last and atomically: a folder without
        it is not a complete checkpoint."""
        folder = step_folder(self.out, steps_done)
        if folder.exists():  # no loop.json (complete ones are never written over): a crash's
            log.warning("removing %s, an incomplete step left by an earlier run", folder)
            shutil.rmtree(folder)
        self.policy.save_checkpoint(folder / "weights", folder / "optim")
        loop = {"step": steps_done, "rng": self.rng.getstate(), "rows": self.history}
        tmp = folder / "loop.json.tmp"
        tmp.write_text(json.dumps(loop))
        tmp.replace(folder / "loop.json")

    def draw(self, n: int) -> list[Example]:
        if self.examples is None:
            return addition_examples(self.rng, n)
        return [self.rng.choice(self.examples) for _ in range(n)]

    def record(self, row: dict) -> None:
        self.history.append(row)
        self.metrics_file.write(json.dumps(row) + "\n")
        self.metrics_file.flush()

    def sft_step(self, step: int) -> dict:
        cfg = self.cfg
        examples = self.draw(cfg.sft_batch)
        if self.examples is None:
            examples = noisy_labels(self.rng, examples, cfg.sft_wrong_fraction)
        tok = self.tokenizer
        prompts = [encode_prompt(tok, e.prompt) for e in examples]
        answers = [
            tok(e.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            for e in examples
        ]
        batch = sequences_batch(prompts, answers, tok.pad_token_id)
        mbs = cfg.step_mbs(cfg.sft_batch)
        m = self.policy.train(batch, NLLLoss(), gbs=cfg.sft_batch, mbs=mbs)
        return {
            "step": step,
            "phase": "sft",
            "loss": m["loss"],
            "reward_mean": None,
            "grad_norm": m["grad_norm"],
            "lr": m["lr"],
            **{k: v for k, v in m.items() if k.startswith("moe_")},  # an MoE model's per expert
        }

    def grpo_step(self, step: int, loss_fn: ClippedPGLoss) -> dict:
        cfg = self.cfg
        examples = self.draw(cfg.prompts_per_step)
        seed = cfg.seed * 100_003 + step
        prompts = [e.prompt for e in examples]
        if self.sampler is None:
            samples, refit = self.generate(prompts, seed), {"refit_s": None, "weight_version": None}
        else:
            samples, refit = self.refit_and_sample(prompts, seed, step)
        answers = [e.answer for e in examples for _ in range(cfg.group_size)]
        rewards = [reward(t, a) for t, a in zip(samples.texts, answers, strict=True)]
        advantages = group_advantages(
            rewards,
            cfg.group_size,
            leave_one_out=cfg.leave_one_out_baseline,
            normalize=cfg.normalize_rewards,
        )
        batch = grpo_batch(samples, advantages, self.tokenizer.pad_token_id)
        self.policy.prepare_for_lp_inference()
        batch["prev_logprobs"] = self.policy.get_logprobs(data=batch)["logprobs"]
        if "reference_policy_logprobs" in loss_fn.required_keys:  # only with a KL penalty
            ref = self.policy.get_reference_policy_logprobs(data=batch)
            batch["reference_policy_logprobs"] = ref["reference_logprobs"]
        self.policy.prepare_for_training()
        m = self.policy.train(batch, loss_fn)
        keep = (
            "loss",
            "grad_norm",
            "lr",
            "probs_ratio",
            "clipped_fraction",
            "token_mult_prob_error",
            "entropy",
        )
        return {
            "step": step,
            "phase": "grpo",
            "engine": cfg.engine,
            "reward_mean": statistics.fmean(rewards),
            **refit,
            **{k: m[k] for k in keep if k in m},
            **{k: v for k, v in m.items() if k.startswith("moe_")},  # an MoE model's per expert
        }

    def refit_and_sample(self, prompts: list[str], seed: int, step: int) -> tuple[Samples, dict]:
        """The transformers engine's samples after a refit, and the refit's metrics. Each row
        is clamped to the context left after its prompt (as the workers' `generate` and the
        reference's engines do): `max_new_tokens` may be the whole context, as recipes set it."""
        assert self.sampler is not None and self.refit is not None
        refit = self.refit(step)
        context, tok = self.cfg.max_sequence_length, self.tokenizer
        shortest = min(len(encode_prompt(tok, p)) for p in prompts)
        samples = self.sampler.sample(
            prompts,
            n=self.cfg.group_size,
            max_new_tokens=min(self.cfg.max_new_tokens, context - shortest),
            temperature=self.cfg.temperature,
            seed=seed,
        )
        return _within(samples, context, tok), refit

    def generate(self, prompts: list[str], seed: int) -> Samples:
        """The workers' own samples (`Policy.generate`, in the inference memory phase)."""
        tok = self.tokenizer
        encoded = [encode_prompt(tok, p) for p in prompts for _ in range(self.cfg.group_size)]
        batch = sequences_batch(encoded, [[] for _ in encoded], tok.pad_token_id)
        self.policy.prepare_for_lp_inference()
        out = self.policy.generate(data=batch, seed=seed)
        responses, logprobs = [], []
        for row, ids in enumerate(encoded):
            n, end = len(ids), int(out["unpadded_sequence_lengths"][row])
            responses.append(out["output_ids"][row, n:end].tolist())
            logprobs.append(out["logprobs"][row, n:end].tolist())
        texts = [tok.decode(r, skip_special_tokens=True) for r in responses]
        return Samples(
            prompt_ids=encoded, response_ids=responses, response_logprobs=logprobs, texts=texts
        )


def _within(samples: Samples, context: int, tokenizer: object) -> Samples:
    """Each response cut to the `context` left after its prompt (its text decoded again)."""
    s = samples
    rows = zip(s.prompt_ids, s.response_ids, s.response_logprobs, s.texts, strict=True)
    responses, logprobs, texts = [], [], []
    for prompt, response, lps, text in rows:
        room = context - len(prompt)
        if len(response) > room:
            response, lps = response[:room], lps[:room]
            text = tokenizer.decode(response, skip_special_tokens=True)  # type: ignore[attr-defined]
        responses.append(response)
        logprobs.append(lps)
        texts.append(text)
    return Samples(samples.prompt_ids, responses, logprobs, texts)


def run_demo(cfg: DemoConfig, inputs: DemoInputs | None = None) -> list[dict]:
    """Run SFT then GRPO; write metrics.jsonl, metrics.png and the final HF export under cfg.out."""
    start = time.time()
    run = Run(cfg, load_inputs(cfg) if inputs is None else inputs)
    try:
        _steps(run, cfg)
        run.policy.save_hf_pretrained(run.out / "hf")
    finally:
        run.close()
    from policyworker.demo.plot import plot_metrics

    plot_metrics(run.history, run.out / "metrics.png")
    rewards = [r["reward_mean"] for r in run.history if r["phase"] == "grpo"]
    if len(rewards) >= 10:
        log.info(
            "reward: first 5 GRPO steps %.3f, last 5 %.3f",
            statistics.fmean(rewards[:5]),
            statistics.fmean(rewards[-5:]),
        )
    log.info("demo finished in %.1f s; outputs in %s", time.time() - start, run.out)
    return run.history


def _steps(run: Run, cfg: DemoConfig) -> None:
    """The SFT steps, then the GRPO steps (from `run.start_step` on a resume), with a progress
    bar, a line per step and a checkpoint every `cfg.save_every` steps."""
    total = cfg.sft_steps + cfg.grpo_steps
    bar = tqdm(total=total, initial=run.start_step, desc="demo", unit="step", dynamic_ncols=True)
    loss_fn = ClippedPGLoss(cfg.loss)
    for step in range(run.start_step, total):
        if step == cfg.sft_steps:
            run.policy.set_learning_rate(cfg.grpo_lr)
        if step < cfg.sft_steps:
            row = run.sft_step(step)
            bar.set_postfix(phase="sft", loss=f"{row['loss']:.3f}")
            if step % 50 == 0 or step == cfg.sft_steps - 1:  # SFT steps are many and fast
                tqdm.write(f"sft  step {step:4d}  loss {row['loss']:.4f}")
        else:
            row = run.grpo_step(step, loss_fn)
            bar.set_postfix(phase="grpo", reward=f"{row['reward_mean']:.2f}")
            tqdm.write(
                f"grpo step {step:4d}  reward {row['reward_mean']:.3f}  loss {row['loss']:+.4f}"
            )
        run.record(row)
        bar.update()
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            run.save(step + 1)
    bar.close()


def _rng_state(saved: list) -> tuple:
    """random.Random's state from its JSON form (lists where it had tuples)."""
    version, internal, gauss = saved
    return (version, tuple(internal), gauss)
