"""How a batch is cut into micro-batches: a fixed number of rows, a token budget, or packed bins.

The variant is chosen once, from the config, when the worker is built (`build_plan`):

* `FixedSize`: consecutive runs of `mbs` rows, each padded to its own longest row.
* `TokenBudget` (`dynamic_batching`): rows sorted by length, cut where a micro-batch padded to its
  longest would exceed the token budget.
* `Packed` (`sequence_packing`): rows packed end to end into bins of at most the token budget
  (THD layout, `PackedSeqParams`), by the configured bin-packing algorithm.

Rows that must share a micro-batch (`rows_per_example`, 2 for DPO pairs) are planned as one unit.
A `Microbatch` remembers which rows of the batch it holds, so results go back in the caller's
order; its `data` is always the padded `[n, S]` rows, which is what the losses read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from policyworker.config import PolicyConfig
from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.data.contract import ROUTES
from policyworker.data.packing import PACKERS, PackedLayout, sorted_cuts
from policyworker.ops.packed import round_up
from policyworker.parallel.context import ContextGroup, ContextSplit
from policyworker.parallel.dims import Groups, ParallelDims


def trim_to_longest(mb: BatchedDataDict, multiple: int = 1) -> BatchedDataDict:
    """Per-token fields [B, S, ...] cut (or padded: zeros, routes -1 — left to the router, as
    a route of zeros would send the token to expert 0 K times) to the longest row rounded up to
    `multiple` (sequence parallelism needs lengths that TP divides)."""
    seq = mb["input_ids"].shape[1]
    width = round_up(int(mb["input_lengths"].max()), multiple)
    if width == seq:
        return mb

    def fit(key: str, v: torch.Tensor) -> torch.Tensor:
        if width < seq:
            return v[:, :width]
        pad = v.new_full((v.shape[0], width - seq, *v.shape[2:]), -1 if key == ROUTES else 0)
        return torch.cat([v, pad], dim=1)

    return BatchedDataDict(
        {
            k: fit(k, v)
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == seq
            else v
            for k, v in mb.items()
        }
    )


@dataclass(frozen=True, slots=True)
class Microbatch:
    """Some rows of a batch, as the model sees them (padded `[n, S]` or packed `[1, T]`)."""

    rows: list[int]
    """Indices into the batch this was cut from (empty for a filler that adds nothing)."""
    data: BatchedDataDict
    """Those rows, trimmed to their longest: what the loss reads."""
    layout: PackedLayout | None = None
    """The packed layout of the rows, or None when they run padded."""
    context: ContextSplit | None = None
    """With context parallelism: this rank's share of the packed layout."""

    @property
    def size(self) -> int:
        return self.data.size

    @property
    def model_shape(self) -> tuple[int, int]:
        """(batch, sequence) of the model's input: (n, S) padded, (1, T) packed, (1, T/CP)."""
        if self.layout is None:
            return tuple(self.data["input_ids"].shape)  # type: ignore[return-value]
        return 1, self.layout.total // (self.context.size if self.context else 1)

    def model_inputs(
        self, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, PackedSeqParams | None]:
        """(input_ids, position_ids, packed_seq_params) for megatron's GPTModel."""
        ids = self.data["input_ids"]
        if self.layout is None:
            return ids, torch.arange(ids.shape[1], device=device).expand_as(ids), None
        params = self.layout.seq_params(device)
        if self.context is not None:
            params = self.context.seq_params(params, device)
        return self.to_local(self.pack(ids)), self.to_local(self.layout.positions(device)), params

    def padding_mask(self, device: torch.device) -> torch.Tensor:
        """[b, t] in the model's input layout (this CP rank's tokens): True where no row's token
        is (padding after a row, between packed sequences; all of a filler)."""
        ids = self.data["input_ids"]
        lengths = self.data["input_lengths"] if self.rows else torch.zeros(ids.shape[0])
        valid = torch.arange(ids.shape[1], device=device)[None, :] < lengths.to(device)[:, None]
        return ~self.to_local(self.pack(valid))

    def routes(self) -> torch.Tensor | None:
        """The rows' `routed_experts` [b, t, L, K] in the model's input layout (None when the
        batch has none); -1 where no row's token is (packing gaps: the router chooses there)."""
        if ROUTES not in self.data:
            return None
        return self.to_local(self.pack(self.data[ROUTES] + 1) - 1)

    def segments(self, per_sequence: bool) -> tuple[torch.Tensor, int]:
        """Load-balancing segments [b, t] in the model's input layout and their number: each
        real token's row (`per_sequence`) or 0 (the whole micro-batch is one); -1 elsewhere."""
        ids = self.data["input_ids"]
        lengths = self.data["input_lengths"] if self.rows else torch.zeros_like(ids[:, 0])
        n, s = ids.shape
        valid = torch.arange(s, device=ids.device)[None, :] < lengths[:, None]
        rows = torch.arange(n, device=ids.device)[:, None] if per_sequence else 0
        seg = torch.where(valid, rows, -1)
        return self.to_local(self.pack(seg + 1) - 1), (n if per_sequence else 1)

    def pack(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-row values [n, S, ...] in the model's layout (the whole sequence)."""
        return rows if self.layout is None else self.layout.pack(rows)

    def to_local(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position values [b, T, ...] of the whole sequence -> this CP rank's tokens."""
        if self.context is None:
            return values
        return values[:, self.context.local(values.device)]

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """This CP rank's per-token outputs [b, T/CP, ...] -> the whole sequence's [b, T, ...]."""
        return values if self.context is None else self.context.gather_outputs(values, dim=1)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position model outputs back to [n, S, ...] rows (zeros past each length)."""
        if self.layout is None:
            return values
        return self.layout.unpack(values, self.data["input_ids"].shape[1])


@dataclass(frozen=True, slots=True)
class RowShape:
    """How the unpacked plans hand rows to the model: padded to the longest row (rounded up to a
    multiple of TP under sequence parallelism), or, under context parallelism, packed one row
    per sequence and split over CP."""

    multiple: int = 1
    context: ContextGroup | None = None
    cp_divisor: int = 1
    """Under CP, each row is padded to a multiple of this (2 * CP, and TP * CP with SP)."""

    def microbatch(self, rows: list[int], batch: BatchedDataDict) -> Microbatch:
        data = trim_to_longest(batch.select_indices(rows), self.multiple)
        return _with_context(rows, data, None, self.context, self.cp_divisor)

    def filler(self, batch: BatchedDataDict, rows_per_example: int) -> Microbatch:
        data = _filler_rows(batch, rows_per_example, self.multiple)
        return _with_context([], data, None, self.context, self.cp_divisor)


def _budget(train: bool, train_tokens: int, logprob_tokens: int, field: str) -> tuple[int, str]:
    """(the budget of this kind of call, its dotted config name)."""
    name = "train_mb_tokens" if train else "logprob_mb_tokens"
    return (train_tokens if train else logprob_tokens), f"{field}.{name}"


@dataclass(frozen=True, slots=True)
class FixedSize:
    """`mbs` consecutive rows per micro-batch."""

    shape: RowShape = RowShape()

    def check(self, lengths: Sequence[int], *, train: bool, rows_per_example: int) -> None:
        """Nothing to check: any row fits."""

    def split(
        self, batch: BatchedDataDict, *, train: bool, mbs: int, rows_per_example: int = 1
    ) -> list[Microbatch]:
        return [
            self.shape.microbatch(list(range(start, min(start + mbs, batch.size))), batch)
            for start in range(0, batch.size, mbs)
        ]

    def filler(self, batch: BatchedDataDict, like: Microbatch, rows_per_example: int) -> Microbatch:
        return self.shape.filler(batch, rows_per_example)


@dataclass(frozen=True, slots=True)
class TokenBudget:
    """Rows sorted by length, cut at the budget of padded tokens (`n * longest`)."""

    train_tokens: int
    logprob_tokens: int
    shape: RowShape = RowShape()
    field: str = "dynamic_batching"

    def check(self, lengths: Sequence[int], *, train: bool, rows_per_example: int) -> None:
        budget, name = _budget(train, self.train_tokens, self.logprob_tokens, self.field)
        for unit in _units(list(lengths), rows_per_example):
            if len(unit) * max(unit) > budget:
                raise ValueError(
                    f"{name}: a micro-batch of {len(unit)} row(s) of length {max(unit)} needs "
                    f"{len(unit) * max(unit)} tokens, over the budget of {budget}"
                )

    def split(
        self, batch: BatchedDataDict, *, train: bool, mbs: int, rows_per_example: int = 1
    ) -> list[Microbatch]:
        budget, _ = _budget(train, self.train_tokens, self.logprob_tokens, self.field)
        units = _units(batch["input_lengths"].tolist(), rows_per_example)
        # A unit of r rows costs r * its longest row per unit of its bin's longest row.
        longest = [max(u) for u in units]
        bins = sorted_cuts(longest, budget // rows_per_example)
        return [self.shape.microbatch(_expand(b, rows_per_example), batch) for b in bins]

    def filler(self, batch: BatchedDataDict, like: Microbatch, rows_per_example: int) -> Microbatch:
        return self.shape.filler(batch, rows_per_example)


@dataclass(frozen=True, slots=True)
class Packed:
    """Rows packed end to end into bins of at most the budget (each padded to `divisible_by`)."""

    algorithm: str
    train_tokens: int
    logprob_tokens: int
    divisible_by: int
    uniform: bool = False
    """Pad every bin of a call to the same length (pipeline parallelism wants one shape)."""
    context: ContextGroup | None = None
    """With context parallelism: every bin split over the CP group."""
    field: str = "sequence_packing"

    def _unit_sizes(self, lengths: list[int], rows_per_example: int) -> list[int]:
        return [
            sum(round_up(n, self.divisible_by) for n in u)
            for u in _units(lengths, rows_per_example)
        ]

    def check(self, lengths: Sequence[int], *, train: bool, rows_per_example: int) -> None:
        budget, name = _budget(train, self.train_tokens, self.logprob_tokens, self.field)
        for size, unit in zip(
            self._unit_sizes(list(lengths), rows_per_example),
            _units(list(lengths), rows_per_example),
            strict=True,
        ):
            if size > budget:
                raise ValueError(
                    f"{name}: a sequence (group) of length {sum(unit)} takes {size} tokens "
                    f"padded to multiples of {self.divisible_by}, over the budget of {budget}"
                )

    def split(
        self, batch: BatchedDataDict, *, train: bool, mbs: int, rows_per_example: int = 1
    ) -> list[Microbatch]:
        budget, _ = _budget(train, self.train_tokens, self.logprob_tokens, self.field)
        lengths = batch["input_lengths"].tolist()
        bins = PACKERS[self.algorithm](self._unit_sizes(lengths, rows_per_example), budget)
        row_bins = [_expand(b, rows_per_example) for b in bins]
        total = None
        if self.uniform:
            total = max(sum(round_up(lengths[r], self.divisible_by) for r in b) for b in row_bins)
        return [
            _with_context(
                b,
                trim_to_longest(batch.select_indices(b)),
                self._layout([lengths[r] for r in b], total),
                self.context,
                self.divisible_by,
            )
            for b in row_bins
        ]

    def _layout(self, lengths: list[int], total: int | None) -> PackedLayout:
        return PackedLayout.of(lengths, divisible_by=self.divisible_by, total=total)

    def filler(self, batch: BatchedDataDict, like: Microbatch, rows_per_example: int) -> Microbatch:
        data = _filler_rows(batch, rows_per_example)
        total = like.layout.total if self.uniform and like.layout is not None else None
        layout = self._layout(data["input_lengths"].tolist(), total)
        return _with_context([], data, layout, self.context, self.divisible_by)


MicrobatchPlan = FixedSize | TokenBudget | Packed

_FILLER_LENGTH = 2  # the shortest row whose loss slice (positions 1:) is not empty


def _units(lengths: list[int], rows_per_example: int) -> list[list[int]]:
    r = rows_per_example
    return [lengths[i : i + r] for i in range(0, len(lengths), r)]


def _expand(units: list[int], rows_per_example: int) -> list[int]:
    return [u * rows_per_example + k for u in units for k in range(rows_per_example)]


def _with_context(
    rows: list[int],
    data: BatchedDataDict,
    layout: PackedLayout | None,
    context: ContextGroup | None,
    divisor: int,
) -> Microbatch:
    """The micro-batch; under context parallelism always packed (a row per sequence if the plan
    did not pack) and split over the CP group."""
    if context is None:
        return Microbatch(rows=rows, data=data, layout=layout)
    if layout is None:
        layout = PackedLayout.of(data["input_lengths"].tolist(), divisible_by=divisor)
    return Microbatch(rows=rows, data=data, layout=layout, context=context.split(layout.padded))


def _filler_rows(
    batch: BatchedDataDict, rows_per_example: int, multiple: int = 1
) -> BatchedDataDict:
    """Rows that add no loss, no tokens and no gradient: the first rows of the batch cut to two
    tokens, with zero masks. Fillers let every data-parallel rank run as many micro-batches."""
    data = batch.select_indices(list(range(rows_per_example)))
    width = min(_FILLER_LENGTH, data["input_ids"].shape[1])
    data["input_lengths"] = torch.full_like(data["input_lengths"], width)
    data = trim_to_longest(data, multiple)
    for key in ("token_mask", "sample_mask"):
        if key in data:
            data[key] = torch.zeros_like(data[key])
    return data


def build_plan(cfg: PolicyConfig, dims: ParallelDims, groups: Groups) -> MicrobatchPlan:
    """The micro-batching variant the config asks for (budgets default to the row-count sizes
    times the longest allowed sequence)."""
    train_default = cfg.train_micro_batch_size * cfg.max_total_sequence_length
    logprob_default = cfg.logprob_batch_size * cfg.max_total_sequence_length
    multiple = dims.sequence_multiple
    context = None
    cp_divisor = 1
    if dims.cp > 1:
        context = ContextGroup(rank=groups.cp_rank, size=dims.cp, group=groups.cp)
        # every rank gets whole chunks; with SP its T / CP tokens must split over TP too
        cp_divisor = math.lcm(2 * dims.cp, dims.cp * multiple)
    sp, db = cfg.sequence_packing, cfg.dynamic_batching
    if sp.enabled:
        divisor = sp.make_sequence_length_divisible_by or math.lcm(cp_divisor, multiple)
        if divisor % cp_divisor or divisor % multiple:
            raise ValueError(
                "sequence_packing.make_sequence_length_divisible_by: expected a multiple of "
                f"{math.lcm(cp_divisor, multiple)} (2*CP, TP with sequence parallelism), got "
                f"{divisor}"
            )
        return Packed(
            algorithm=sp.algorithm,
            train_tokens=sp.train_mb_tokens or train_default,
            logprob_tokens=sp.logprob_mb_tokens or logprob_default,
            divisible_by=divisor,
            uniform=dims.pp > 1,
            context=context,
        )
    shape = RowShape(multiple=multiple, context=context, cp_divisor=cp_divisor)
    if db.enabled:
        return TokenBudget(
            train_tokens=db.train_mb_tokens or train_default,
            logprob_tokens=db.logprob_mb_tokens or logprob_default,
            shape=shape,
        )
    return FixedSize(shape=shape)
