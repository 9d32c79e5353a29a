"""A simple in-process generation engine: a transformers model that receives the worker's weights.

Stands in for vLLM/SGLang in the demo: `load_weights` is the refit (the worker's HF export copied
into the engine's parameters), `sample` draws a group of responses and their generation logprobs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from policyworker.demo.task import encode_prompt


@dataclass(frozen=True, slots=True)
class Samples:
    """One row per (prompt, sample)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]  # up to and including EOS when produced
    response_logprobs: list[list[float]]  # generation logprobs of response_ids
    texts: list[str]


class HFSampler:
    """Sampling with temperature from a transformers causal LM (no top-k / top-p filtering)."""

    def __init__(
        self, model_dir: str, tokenizer: PreTrainedTokenizerBase, *, device: torch.device
    ) -> None:
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        )
        self.tokenizer = tokenizer
        self.device = device

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Refit: copy HF-named tensors into the engine's parameters."""
        params = dict(self.model.named_parameters())
        seen = set()
        for name, tensor in weights:
            params[name].copy_(tensor)
            seen.add(name)
        if self.model.config.tie_word_embeddings:
            seen.add("lm_head.weight")
        missing = set(params) - seen
        if missing:
            raise ValueError(f"refit is missing {sorted(missing)[:5]}")

    @torch.no_grad()
    def sample(
        self, prompts: list[str], *, n: int, max_new_tokens: int, temperature: float, seed: int
    ) -> Samples:
        tok = self.tokenizer
        encoded = [self.encode_prompt(p) for p in prompts for _ in range(n)]
        width = max(len(e) for e in encoded)
        pad = tok.pad_token_id
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded], device=self.device)
        attn = (
            torch.arange(width, device=self.device)[None, :]
            >= torch.tensor([width - len(e) for e in encoded], device=self.device)[:, None]
        ).long()
        torch.manual_seed(seed)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            eos_token_id=tok.eos_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        new = out.sequences[:, width:]  # [N, T]
        # scores are logits / temperature: their log-softmax is the sampling distribution.
        logprobs = torch.stack([s.float().log_softmax(-1) for s in out.scores], dim=1)  # [N, T, V]
        token_lp = logprobs.gather(-1, new[..., None]).squeeze(-1)
        responses, lps, texts = [], [], []
        for row, lp_row in zip(new.tolist(), token_lp.tolist(), strict=True):
            cut = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
            responses.append(row[:cut])
            lps.append(lp_row[:cut])
            texts.append(tok.decode(row[:cut], skip_special_tokens=True))
        return Samples(
            prompt_ids=encoded, response_ids=responses, response_logprobs=lps, texts=texts
        )

    def encode_prompt(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)
