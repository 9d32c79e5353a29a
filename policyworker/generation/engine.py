"""A small generation engine: a transformers causal LM that samples and scores.

It stands in for vLLM/SGLang: `GenerationProcess` runs one in its own process and refits it
through `policyworker.refit` (its `refit_targets` are the tensors a refit writes); `sample` draws
responses with their generation logprobs, `logprobs` scores sequences with the worker's alignment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from policyworker.model.experts import transformers_view
from policyworker.ops.mxfp8 import SCALE_SUFFIX, dequantize_mxfp8
from policyworker.ops.sampling import restrict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Prompt token ids: BOS (if the tokenizer has one), then the text without special tokens."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + ids


@dataclass(frozen=True, slots=True)
class Samples:
    """One row per (prompt, sample). The driver unpickles these: this module imports
    transformers only where an engine is built."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]  # up to and including EOS when produced
    response_logprobs: list[list[float]]  # generation logprobs of response_ids
    texts: list[str]


class HFEngine:
    """Sampling with temperature, top-k and top-p from a transformers causal LM."""

    def __init__(
        self,
        model_dir: str,
        tokenizer: PreTrainedTokenizerBase | None,
        *,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        load_weights: bool = True,
    ) -> None:
        """`load_weights=False`: random weights of the folder's config (a refit brings them)."""
        from transformers import AutoConfig, AutoModelForCausalLM  # not at the top: see Samples

        if load_weights:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        else:
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        self.model = model.to(device=device, dtype=dtype).eval()
        self.tokenizer = tokenizer
        self.device = device

    def refit_targets(self, info: Mapping[str, tuple[Any, torch.dtype]]) -> dict[str, torch.Tensor]:
        """The tensors a refit of `info` ({on-disk HF name: (shape, dtype)}) writes:
        transformers' parameters, or a view into its fused experts (a tied lm_head shares the
        embedding); for an MXFP8 weight (prequantized refit), a float8 and a uint8 tensor that
        `load_mxfp8` turns into the parameter after each refit."""
        state = self.model.state_dict(keep_vars=True)
        out: dict[str, torch.Tensor] = {}
        self._mxfp8: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in info.items():
            live = transformers_view(state, name.removesuffix(SCALE_SUFFIX))
            if live is None:
                continue
            if dtype in (torch.float8_e4m3fn, torch.uint8):
                out[name] = torch.zeros(tuple(shape), dtype=dtype, device=self.device)
                if dtype == torch.float8_e4m3fn:
                    self._mxfp8[name] = live
            else:
                out[name] = live
        return out

    @torch.no_grad()
    def load_mxfp8(self, targets: Mapping[str, torch.Tensor]) -> None:
        """After a refit, each MXFP8 weight dequantized into its parameter (an FP8 engine would
        compute with the values and scales as they are; this one computes in its dtype)."""
        for name, live in self._mxfp8.items():
            values, scales = targets[name], targets[name + SCALE_SUFFIX]
            live.copy_(dequantize_mxfp8(values, scales).to(live.dtype))

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, S] log p(token_i | tokens_<i) of right-padded rows; 0 at 0 and past the length."""
        ids, lengths = input_ids.to(self.device), lengths.to(self.device)
        mask = (torch.arange(ids.shape[1], device=self.device)[None, :] < lengths[:, None]).long()
        logits = self.model(ids, attention_mask=mask).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return (torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1) * mask).cpu()

    @torch.no_grad()
    def sample(
        self,
        prompts: list[str],
        *,
        n: int,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> Samples:
        """Responses drawn from logits / temperature restricted to the `top_k` most likely tokens
        (0: all) and the smallest set of probability >= `top_p`, renormalized. Their generation
        logprobs are of that distribution (what the token was drawn from, as vLLM reports its
        processed logprobs): with filtering they exceed `get_logprobs`'s by the log of the mass
        kept."""
        tok = self.tokenizer
        assert tok is not None, "sampling needs the engine's tokenizer"
        encoded = [self.encode_prompt(p) for p in prompts for _ in range(n)]
        new, token_lp = self.draw(
            encoded,
            pad_id=tok.pad_token_id,
            eos_id=tok.eos_token_id,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            top_k=top_k,
            top_p=top_p,
        )
        responses, lps, texts = [], [], []
        for row, lp_row in zip(new.tolist(), token_lp.tolist(), strict=True):
            cut = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
            responses.append(row[:cut])
            lps.append(lp_row[:cut])
            texts.append(tok.decode(row[:cut], skip_special_tokens=True))
        return Samples(
            prompt_ids=encoded, response_ids=responses, response_logprobs=lps, texts=texts
        )

    @torch.no_grad()
    def draw(
        self,
        encoded: list[list[int]],
        *,
        pad_id: int,
        eos_id: int | None,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`sample` on token ids: the [N, T] tokens drawn after each prompt (left-padded for
        transformers' generate; `eos_id` None: never stop early) and their logprobs."""
        width = max(len(e) for e in encoded)
        ids = torch.tensor([[pad_id] * (width - len(e)) + e for e in encoded], device=self.device)
        attn = (
            torch.arange(width, device=self.device)[None, :]
            >= torch.tensor([width - len(e) for e in encoded], device=self.device)[:, None]
        ).long()
        torch.manual_seed(seed)
        record = _DrawnLogprobs(temperature, top_k or None, top_p)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=True,
            temperature=1.0,  # applied by `record`, with top-k and top-p
            top_k=None,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad_id,
            eos_token_id=eos_id,
            logits_processor=[record],
            return_dict_in_generate=True,
        )
        new = out.sequences[:, width:]  # [N, T]
        return new, record.finish(new)

    def encode_prompt(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)


class _DrawnLogprobs:
    """A transformers logits processor that makes the sampling distribution itself (logits /
    temperature within top-k and top-p: `ops.sampling.restrict`, transformers' own warpers off)
    and keeps its log-softmax for one step, picking the token drawn from it at the next step
    (and at `finish`): a call holds [N, V], not every step's [N, T, V] scores."""

    def __init__(self, temperature: float, top_k: int | None, top_p: float) -> None:
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.picked: list[torch.Tensor] = []
        self.last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:  # input_ids now end with the token drawn from `last`
            self.picked.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        scores = restrict(scores.float() / self.temperature, self.top_k, self.top_p)
        self.last = scores.log_softmax(-1)
        return scores

    def finish(self, drawn: torch.Tensor) -> torch.Tensor:
        """The logprobs [N, T] of the `drawn` tokens [N, T]."""
        assert self.last is not None
        self.picked.append(self.last.gather(-1, drawn[:, -1:]).squeeze(-1))
        return torch.stack(self.picked, dim=1)[:, : drawn.shape[1]]
