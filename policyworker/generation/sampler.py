"""The worker's `generate`: its settings (`GenerationConfig`, the policy's temperature), stop
rules from the tokenizer and the batch, and a seed per call; the loop is `decode.Decoder`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from policyworker.config import GenerationConfig
from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.data.contract import ROW_IDS
from policyworker.generation.decode import Decoder, Stops, stop_rows
from policyworker.ops.sampling import Sampling


class Sampler:
    """Generation settings over a `Decoder`; each call without a seed takes the next one
    (`seed`, `seed + 1`, ...), so a worker built alike draws alike. A row's draws are keyed by
    the call's seed and the row's id (`row_ids`, the driver's global row index; without it the
    row's place in a contiguous split, dp_rank x B + the row), never by the rank: the data-parallel
    ranks of one call draw independently, and a row draws alike over any number of them."""

    def __init__(
        self,
        decoder: Decoder,
        settings: GenerationConfig,
        *,
        temperature: float,
        eos_ids: tuple[int, ...],
        tokenizer: Any | None,
        seed: int,
        sync_params: Callable[[], None],
    ) -> None:
        """`sync_params`: completes a step's pending parameter gathers (generation reads whole
        parameters)."""
        self.decoder, self.settings, self.temperature = decoder, settings, temperature
        self.sync_params = sync_params
        ids = settings.stop_token_ids
        self.stop_ids = tuple(ids) if ids is not None else eos_ids
        self.tokenizer = tokenizer
        self.next_seed = seed

    def check(self, data: BatchedDataDict, seed: int | None) -> Stops:
        """Validate a call (`ValueError` naming the field); its stop rules."""
        ok = seed is None or (isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0)
        if not ok:
            raise ValueError(f"seed: expected None or an int >= 0, got {seed!r}")
        tok = self.tokenizer
        decode = None if tok is None else (lambda ids: tok.decode(ids, skip_special_tokens=False))
        stops = Stops(
            token_ids=self.stop_ids,
            strings=tuple(self.settings.stop_strings or ()),
            per_row=stop_rows(data),
            decode=decode,
        )
        self.decoder.check(data, stops)
        return stops

    def generate(self, *, data: BatchedDataDict, greedy: bool, seed: int | None) -> BatchedDataDict:
        """The worker's `generate` (`interface.PolicyCalls` documents it)."""
        stops = self.check(data, seed)
        self.sync_params()
        if seed is None:
            seed, self.next_seed = self.next_seed, self.next_seed + 1
        s = self.settings
        how = Sampling(temperature=self.temperature, top_k=s.top_k, top_p=s.top_p, greedy=greedy)
        rows = data.get(ROW_IDS)
        if rows is None:
            b = data["input_ids"].shape[0]
            rows = self.decoder.groups.dp_rank * b + torch.arange(b)
        out = self.decoder.generate(
            data, how, stops, max_new_tokens=s.max_new_tokens, seed=seed, row_ids=rows
        )
        if self.decoder.device.type == "cuda":
            torch.cuda.empty_cache()  # the KV cache leaves no reserved memory behind
        return out
