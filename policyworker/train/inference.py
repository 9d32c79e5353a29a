"""Forward-only collection over a batch: token logprobs and top-k logits, assembled per row.

Both run the same pipeline schedule as training (`schedule.run_microbatches`), forward only;
each output is put back in the batch's row order on the CPU, 0 past each row's length, and every
pipeline stage returns it (the last stage computes, then broadcasts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.data.contract import validate_batch
from policyworker.data.microbatch import Microbatch, MicrobatchPlan
from policyworker.losses.common import LossNeeds
from policyworker.ops.logprobs import Head, LogitOptions, topk
from policyworker.parallel.dims import Groups, broadcast_from_last_stage
from policyworker.train.schedule import MicrobatchFn, loss_inputs, run_microbatches, split_evenly


@dataclass(frozen=True, slots=True, kw_only=True)
class Collector:
    """What every collection runs on: the model, how batches are cut, this rank's groups."""

    model: torch.nn.Module
    plan: MicrobatchPlan
    groups: Groups
    device: torch.device
    logits: LogitOptions
    vocab_size: int
    max_seq_len: int
    default_mbs: int

    def check(self, data: BatchedDataDict, micro_batch_size: int | None, k: int = 1) -> int:
        """Validate a collection's batch (`BatchValidationError`), micro-batch size and top-k;
        returns the micro-batch size."""
        if not isinstance(k, int) or not 1 <= k <= self.vocab_size:
            raise ValueError(f"k: expected an int in [1, {self.vocab_size}], got {k!r}")
        mbs = self.default_mbs if micro_batch_size is None else micro_batch_size
        if not isinstance(mbs, int) or mbs < 1:
            raise ValueError(f"micro_batch_size: expected an int >= 1, got {micro_batch_size!r}")
        validate_batch(data, required=(), max_seq_len=self.max_seq_len, vocab_size=self.vocab_size)
        self.plan.check(data["input_lengths"].tolist(), train=False, rows_per_example=1)
        return mbs

    def logprobs(self, data: BatchedDataDict, mbs: int) -> torch.Tensor:
        """[B, S] fp32: log p(token_i | tokens_<i) at i, 0 at 0 and past the length."""
        needs = LossNeeds(logprobs=True)

        def fn(head: Head, mb: Microbatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            lp = loss_inputs(head, mb, needs, self.logits).logprobs
            assert lp is not None
            return lp.new_zeros(()), {"logprobs": lp}

        (logprobs,) = self.collect(data, mbs, fn, outputs={"logprobs": torch.float32})
        return logprobs

    def topk(self, data: BatchedDataDict, mbs: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, S, k] logits / temperature and their vocabulary ids, largest first."""

        def fn(head: Head, mb: Microbatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            vals, idx = topk(head, k, self.logits)
            vals, idx = mb.unpack(mb.gather(vals)), mb.unpack(mb.gather(idx))
            return vals.new_zeros(()), {"topk_logits": vals, "topk_indices": idx}

        outputs = {"topk_logits": torch.float32, "topk_indices": torch.int64}
        vals, idx = self.collect(data, mbs, fn, outputs=outputs, trailing=(k,))
        return vals, idx

    def collect(
        self,
        data: BatchedDataDict,
        mbs: int,
        fn: MicrobatchFn,
        *,
        outputs: dict[str, torch.dtype],
        trailing: tuple[int, ...] = (),
    ) -> list[torch.Tensor]:
        """Forward-only over micro-batches; each of `outputs` (per-row tensors that `fn`
        returns as metrics) assembled on CPU as [B, S, *trailing], 0 past each length."""
        self.model.eval()
        names = ("input_ids", "input_lengths")
        batch = BatchedDataDict({k: data[k] for k in names}).to(self.device)
        if self.groups.ep_size > 1:  # every forward exchanges tokens with the other EP ranks
            microbatches = split_evenly(batch, self.plan, mbs, 1, self.groups, train=False)
        else:
            microbatches = self.plan.split(batch, train=False, mbs=mbs)
        with torch.no_grad():
            stores = run_microbatches(self.model, microbatches, fn, forward_only=True)
        b, s = data["input_ids"].shape
        valid = torch.arange(s)[None, :] < data["input_lengths"].cpu()[:, None]  # [B, S]
        result = []
        for key, dtype in outputs.items():
            out = torch.zeros((b, s, *trailing), dtype=dtype)  # on CPU: [B, S, k] can be large
            for mb, st in zip(microbatches, stores, strict=False):  # stores: last stage only
                part = st[key].cpu()
                for i, row in enumerate(mb.rows):  # row copies: CPU advanced indexing is slow
                    out[row, : part.shape[1]] = part[i]
            out.masked_fill_(~valid.reshape(b, s, *[1] * len(trailing)), 0)
            result.append(broadcast_from_last_stage(out, self.groups, device=self.device))
        return result
