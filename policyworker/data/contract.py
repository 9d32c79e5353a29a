"""The batch contract (docs/semantics.md), checked before any work or state change.

Per-sample fields are `[B]`, per-token fields `[B, S]` aligned with `input_ids` (right-padded).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

PER_TOKEN_FLOAT = (
    "advantages",
    "prev_logprobs",
    "generation_logprobs",
    "reference_policy_logprobs",
)
PER_TOKEN_MASK = ("token_mask",)
PER_SAMPLE = ("sample_mask", "rewards")
PER_TOKEN_TOPK = ("teacher_topk_logits", "teacher_topk_indices")  # [B, S, k], as get_topk_logits
_MUST_BE_FINITE = (
    "advantages",
    "token_mask",
    "sample_mask",
    "rewards",
    "teacher_topk_logits",
    "prev_logprobs",
    "reference_policy_logprobs",
)
_IN_UNIT_INTERVAL = ("token_mask", "sample_mask")  # weights: 0 drops, fractions scale
_ID_DTYPES = (torch.int32, torch.int64)  # what an embedding lookup takes


class BatchValidationError(ValueError):
    """A batch breaks the contract: the message names the field and what was expected."""


def _fail(field: str, expected: str, got: str) -> None:
    raise BatchValidationError(f"batch field {field!r}: expected {expected}, got {got}")


def validate_batch(
    data: Any,
    *,
    required: Iterable[str],
    max_seq_len: int,
    vocab_size: int,
) -> tuple[int, int]:
    """Check `data` against the contract; returns (B, S). Raises `BatchValidationError`."""
    if not isinstance(data, dict):
        raise BatchValidationError(f"batch: expected a BatchedDataDict, got {type(data).__name__}")
    keys = {"input_ids", "input_lengths", *required}
    missing = sorted(k for k in keys if k not in data)
    if missing:
        raise BatchValidationError(
            f"batch is missing required field(s) {missing}; has {sorted(data)}"
        )
    ids = data["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        _fail("input_ids", "a 2-D integer tensor [B, S]", _describe(ids))
    if ids.dtype not in _ID_DTYPES:
        _fail("input_ids", "dtype int64 or int32", str(ids.dtype))
    b, s = ids.shape
    if b == 0 or s == 0:
        _fail("input_ids", "a non-empty [B, S]", str(tuple(ids.shape)))
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        _fail(
            "input_ids",
            f"token ids in [0, {vocab_size})",
            f"range [{int(ids.min())}, {int(ids.max())}]",
        )
    lengths = data["input_lengths"]
    _check_shape("input_lengths", lengths, (b,), integer=True)
    # Rows are judged by their lengths, not by the tensor's width: padding past the longest
    # row is never computed on (micro-batches are cut to their longest row).
    longest = min(s, max_seq_len)
    if int(lengths.min()) < 1 or int(lengths.max()) > longest:
        _fail(
            "input_lengths",
            f"values in [1, min(S={s}, max_total_sequence_length={max_seq_len})]",
            f"range [{int(lengths.min())}, {int(lengths.max())}]",
        )
    for key in keys:
        if key in PER_TOKEN_FLOAT:
            _check_shape(key, data[key], (b, s), integer=False)
        elif key in PER_TOKEN_MASK:
            _check_shape(key, data[key], (b, s), integer=False)
            _check_zero_past(key, data[key], lengths)
        elif key in PER_SAMPLE:
            _check_shape(key, data[key], (b,), integer=False)
    if any(key in keys for key in PER_TOKEN_TOPK):
        _check_topk(data, b, s, vocab_size)
    return b, s


@dataclass(frozen=True, slots=True)
class BatchRules:
    """The limits every batch of one worker meets — the context (`max_total_sequence_length`)
    and the model's true vocabulary — in one object: made once (`assembly`), checked by every
    service that takes a batch, and by the driver before it shards one."""

    max_seq_len: int
    vocab_size: int

    def check(self, data: Any, required: Iterable[str] = ()) -> tuple[int, int]:
        """`validate_batch` under these limits; returns (B, S)."""
        limits = {"max_seq_len": self.max_seq_len, "vocab_size": self.vocab_size}
        return validate_batch(data, required=required, **limits)


def _check_zero_past(key: str, mask: torch.Tensor, lengths: torch.Tensor) -> None:
    """A mask's weight past a row's end would count a padding token: refuse it."""
    past = torch.arange(mask.shape[1])[None, :] >= lengths.cpu()[:, None]
    outside = (mask.cpu() != 0) & past
    if outside.any():
        row, pos = (int(i) for i in outside.nonzero()[0])
        got = f"{float(mask[row, pos])} at row {row}, position {pos} (length {int(lengths[row])})"
        _fail(key, "0 past each row's input_lengths", got)


def _check_topk(data: Any, b: int, s: int, vocab_size: int) -> None:
    """The teacher's top-k pair: [B, S, k] logits (float) and vocabulary ids, same k."""
    logits, ids = (data.get(key) for key in PER_TOKEN_TOPK)
    for key, value in zip(PER_TOKEN_TOPK, (logits, ids), strict=True):
        if not isinstance(value, torch.Tensor) or value.dim() != 3 or value.shape[:2] != (b, s):
            _fail(key, f"a tensor [B={b}, S={s}, k]", _describe(value))
    if logits.shape[2] == 0:
        _fail("teacher_topk_logits", "k >= 1", str(list(logits.shape)))
    if logits.shape != ids.shape:
        _fail(
            "teacher_topk_indices",
            f"the shape of teacher_topk_logits {list(logits.shape)}",
            str(list(ids.shape)),
        )
    _check_shape("teacher_topk_logits", logits, tuple(logits.shape), integer=False)
    if not logits.dtype.is_floating_point:
        _fail("teacher_topk_logits", "a floating-point dtype", str(logits.dtype))
    _check_shape("teacher_topk_indices", ids, tuple(ids.shape), integer=True)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        _fail(
            "teacher_topk_indices",
            f"ids in [0, {vocab_size})",
            f"range [{int(ids.min())}, {int(ids.max())}]",
        )


def _check_shape(key: str, value: Any, shape: tuple[int, ...], *, integer: bool) -> None:
    if not isinstance(value, torch.Tensor):
        _fail(key, f"a tensor of shape {list(shape)}", _describe(value))
    if tuple(value.shape) != shape:
        _fail(key, f"shape {list(shape)}", str(list(value.shape)))
    if integer and value.dtype not in _ID_DTYPES:
        _fail(key, "dtype int64 or int32", str(value.dtype))
    if key in PER_TOKEN_FLOAT and not value.dtype.is_floating_point:
        _fail(key, "a floating-point dtype", str(value.dtype))
    # A generation logprob may be -inf (a token the generator filtered out); nothing may be NaN.
    if key in _MUST_BE_FINITE and not torch.isfinite(value).all():
        _fail(key, "finite values", "NaN or inf")
    if torch.isnan(value).any() or (value == float("inf")).any():
        _fail(key, "no NaN or +inf", "NaN or +inf")
    if key in _IN_UNIT_INTERVAL and ((value < 0) | (value > 1)).any():
        _fail(key, "values in [0, 1]", f"range [{float(value.min())}, {float(value.max())}]")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {list(value.shape)} {value.dtype}"
    return type(value).__name__


ROW_IDS = "row_ids"
"""[B] ints in [0, 2**31): each row's index in the caller's whole batch, which keys the row's
random draws in `generate` (the driver sets it for each data-parallel shard; default: the
shard's place, dp_rank x B + the row)."""


def check_row_ids(data: Any) -> None:
    """`row_ids`, if given: [B] integers in [0, 2**31). Raises `BatchValidationError`."""
    ids = data.get(ROW_IDS)
    if ids is None:
        return
    _check_shape(ROW_IDS, ids, (data["input_ids"].shape[0],), integer=True)
    if int(ids.min()) < 0 or int(ids.max()) >= 2**31:
        _fail(ROW_IDS, "ints in [0, 2**31)", f"range [{int(ids.min())}, {int(ids.max())}]")


ROUTES = "routed_experts"
"""[B, S, L, K] ints: the K experts each token was sent to in each of the L MoE layers (a
generation engine's routes, for router replay); a token's row of all -1 is left to the router."""


def check_routes(data: Any, *, layers: int, topk: int, experts: int) -> None:
    """`routed_experts` against the model: [B, S, layers, topk] integers, each token's row in a
    layer either K distinct expert ids in [0, experts) or all -1. Raises `BatchValidationError`."""
    b, s = data["input_ids"].shape
    routes = data.get(ROUTES)
    _check_shape(ROUTES, routes, (b, s, layers, topk), integer=True)
    missing = routes < 0
    if ((routes < -1) | (routes >= experts)).any():
        _fail(ROUTES, f"expert ids in [0, {experts}) or -1", f"range [{int(routes.min())}, "
              f"{int(routes.max())}]")  # fmt: skip
    if (missing.any(-1) & ~missing.all(-1)).any():
        _fail(ROUTES, "each token's top-k all given or all -1", "a row with some -1")
    ordered = routes.sort(dim=-1).values
    if ((ordered[..., 1:] == ordered[..., :-1]) & ~missing[..., 1:]).any():
        _fail(ROUTES, f"{topk} distinct experts per token and layer", "a repeated expert id")


FULL_PAYLOAD = "teacher_full_payload"
"""[B, S, D]: a teacher's final hidden states (D = its hidden size) or full-vocabulary logits."""


def check_full_payload(
    data: Any, *, hidden: int | None, vocab: int, indices: list[int] | None
) -> None:
    """A full-vocabulary distillation batch: `teacher_full_payload` [B, S, D] of finite floats,
    D = `hidden` (hidden states) or, with `hidden=None` (logits), D >= `vocab`; with `indices`,
    `teacher_index` [B], each one of them. Raises `BatchValidationError`."""
    b, s = data["input_ids"].shape
    x = data.get(FULL_PAYLOAD)
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[:2] != (b, s):
        _fail(FULL_PAYLOAD, f"a tensor [B={b}, S={s}, D]", _describe(x))
    if not x.dtype.is_floating_point:
        _fail(FULL_PAYLOAD, "a floating-point dtype", str(x.dtype))
    d = x.shape[2]
    if hidden is not None and d != hidden:
        _fail(FULL_PAYLOAD, f"D = {hidden} (the teacher's hidden size: hidden states)", f"D={d}")
    if hidden is None and d < vocab:
        _fail(FULL_PAYLOAD, f"D >= {vocab} (the vocabulary: logits)", f"D={d}")
    if not torch.isfinite(x).all():
        _fail(FULL_PAYLOAD, "finite values", "NaN or inf")
    if indices is None:
        return
    which = data.get("teacher_index")
    _check_shape("teacher_index", which, (b,), integer=True)
    if not torch.isin(which.cpu(), torch.tensor(indices)).all():
        _fail("teacher_index", f"one of the loaded teachers {indices}", str(which.tolist()))
