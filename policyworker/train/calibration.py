"""FP8 KV-cache scales from a calibration batch (the seed's `calibrate_qkv_fp8_scales`): one
scoring pass with `model.calibration.QKVAmax` recording each layer's Q/K/V after RoPE."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.model.calibration import QKVAmax, check_calibration, fp8_scales, save_json
from policyworker.train.scoring import Scorer


@dataclass(frozen=True)
class Calibration:
    """The worker's `calibrate_qkv_fp8_scales` over its scorer (`model`: the unwrapped
    GPTModel, whose layers the probe hooks)."""

    scorer: Scorer
    model: torch.nn.Module

    def calibrate_qkv_fp8_scales(
        self,
        *,
        data: BatchedDataDict,
        micro_batch_size: int | None,
        percentile: float,
        margin: float,
        include_q: bool,
        save_path: str | Path | None,
    ) -> dict[str, Any]:
        """FP8 KV-cache scales from the Q/K/V of a forward over `data`; its routers choose
        (calibration batches carry no routes, as NeMo-RL's); the JSON at `save_path` is written
        by rank 0. Every rank returns the same result."""
        check_calibration(percentile, margin, include_q)
        mbs = self.scorer.check(data, micro_batch_size)
        with QKVAmax(self.model, self.model.config.num_layers) as probe:
            self.scorer.logprobs(data, mbs)
        amax = probe.amax(percentile)
        result = fp8_scales(amax, percentile=percentile, margin=margin, include_q=include_q)
        if save_path is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            save_json(result, save_path)
        return result
