"""Generation in the worker: the model that trains samples the responses, with no weight
conversion and no refit, so its logprobs are the training forward's (`ops.sampling`).

Our own decode loop over our layer spec, not megatron's inference engines: the dynamic engine
needs flash-attn (not available here), and the static one caches keys before RoPE, which in our
model is applied inside the core attention (`model/attention/cached.py`: the cache's phase).
Each step is one forward through megatron's pipeline schedule (forward only, one micro-batch:
the whole batch), so TP and PP work as in `get_logprobs`; the last stage gathers the step's
logits over TP, draws the tokens and broadcasts them to the other stages. Rows finish at
different steps (a stop token, a stop string, `max_new_tokens`, the context's end) and keep
their slot, fed padding, until every row is done. Sequence parallelism is switched off for the
call (megatron's `set_model_to_sequence_parallel`): one token per row cannot be split over TP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.utils import set_model_to_sequence_parallel
from megatron.core.utils import get_model_config, unwrap_model

from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.data.contract import ROUTES, BatchRules, check_row_ids
from policyworker.generation.graphs import GraphedStep
from policyworker.model.attention.cache import Step
from policyworker.model.attention.cached import Generating
from policyworker.model.build import output_head, set_mode
from policyworker.model.paths import ForwardPaths
from policyworker.model.routers import Routers
from policyworker.ops.logprobs import Head, LogitOptions, full_logits
from policyworker.ops.sampling import Sampling, next_tokens
from policyworker.parallel.dims import Groups, broadcast_from_last_stage

STOP_STRINGS = "stop_strings"  # the batch's optional per-row column (NeMo-RL's)


@dataclass(frozen=True, slots=True, kw_only=True)
class Stops:
    """When a row ends: after one of `token_ids`, or once its response's text contains one of
    `strings` (with a row's own extra strings), decoded by `decode`."""

    token_ids: tuple[int, ...]
    strings: tuple[str, ...] = ()
    per_row: tuple[tuple[str, ...], ...] | None = None
    decode: Callable[[list[int]], str] | None = None

    def by_text(self, row: int) -> tuple[str, ...]:
        return self.strings + (self.per_row[row] if self.per_row else ())


@dataclass(frozen=True, slots=True, kw_only=True)
class Decoder:
    """What generation runs on: the model, this rank's groups, the vocabulary and context."""

    model: torch.nn.Module
    groups: Groups
    device: torch.device
    logits: LogitOptions
    """This rank's vocabulary slice and the true vocabulary (the temperature is `Sampling`'s)."""
    rules: BatchRules
    """The context and vocabulary every batch meets."""
    pad_id: int
    paths: ForwardPaths
    """The model's phases: generation's attention kernels and matmul rows (`model/paths.py`)."""
    routers: Routers | None = None
    """An MoE model's routers, whose choices a generation records (`routed_experts`)."""
    local: bool = False
    """The whole model runs on this rank (no TP, PP, CP or experts): decode steps run without
    the pipeline schedule, the host one step behind the device (`_Run._decode_local`)."""
    graphs: bool = False
    """Decode steps as CUDA graph replays (`generation.graphs`): a `local` model on a GPU."""

    def check(self, data: BatchedDataDict, stops: Stops) -> None:
        """A generation batch: right-padded prompts with room for a new token; stop strings
        only with a tokenizer (`ValueError` naming the field)."""
        self.rules.check(data)
        check_row_ids(data)
        longest = int(data["input_lengths"].max())
        if longest >= self.rules.max_seq_len:
            raise ValueError(
                f"input_lengths: a prompt of {longest} tokens leaves no room to generate under "
                f"max_total_sequence_length={self.rules.max_seq_len}"
            )
        rows = data.get(STOP_STRINGS)
        if rows is not None and (
            not isinstance(rows, list)
            or len(rows) != data["input_ids"].shape[0]
            or not all(r is None or all(isinstance(s, str) and s for s in r) for r in rows)
        ):
            raise ValueError(f"{STOP_STRINGS}: expected one list of strings (or None) per row")
        if (stops.strings or rows) and stops.decode is None:
            raise ValueError("stop_strings: need the worker's tokenizer (pass tokenizer=)")

    def generate(
        self,
        data: BatchedDataDict,
        how: Sampling,
        stops: Stops,
        *,
        max_new_tokens: int,
        seed: int,
        row_ids: torch.Tensor,
    ) -> BatchedDataDict:
        """The reference's generation keys for right-padded prompts: `output_ids` [B, W]
        (prompt, response, then padding; W the longest row), `logprobs` [B, W] (0 on the
        prompt), lengths, `truncated`; an MoE model's `routed_experts` [B, W, L, K] too.
        `row_ids` [B] key each row's draws (`ops.draw`)."""
        lengths = data["input_lengths"].to(torch.long).cpu()
        width = int(lengths.max())
        ids = data["input_ids"][:, :width].to(self.device)
        limits = torch.clamp(self.rules.max_seq_len - lengths, max=max_new_tokens)  # >= 1 (check)
        capacity = int((lengths + limits).max())
        run = _Run(
            self, ids, lengths, limits, how, stops, seed, row_ids.to(self.device, torch.long)
        )
        set_mode(self.model, training=False)
        try:
            with (
                torch.no_grad(),
                _no_sequence_parallel(self.model),
                self.paths.generating(self.model, capacity) as phase,
            ):
                run.loop(phase)
        finally:
            if self.routers is not None:
                self.routers.reset()
        return run.result()

    def forward(
        self, ids: torch.Tensor, phase: Generating, pick: torch.Tensor, padding: torch.Tensor
    ) -> torch.Tensor | None:
        """One step (`phase.step`) through the pipeline: the logits [B, V] (the whole
        vocabulary) at positions `pick` [B] of `ids` [B, s] on the last stage; None on the
        others."""
        model = self.model
        extra = {"padding_mask": padding} if self.routers is not None else {}
        positions = phase.locate(ids.shape[1]).T
        if self.routers is not None:  # the routers choose, and record what they chose
            self.routers.begin(None, None, training=False)

        def forward_step(data_iterator: Iterator[None], model: torch.nn.Module) -> Any:
            next(data_iterator)
            out = model(ids, positions, None, output_processor=output_head, **extra)

            def loss_func(head: Head) -> tuple[torch.Tensor, torch.Tensor, dict]:
                logits = self._logits(head, pick)
                return logits.new_zeros(()), torch.ones((), dtype=torch.int), {"logits": logits}

            return out, loss_func

        stores = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([None]),
            model=[model],
            num_microbatches=1,
            seq_length=ids.shape[1],
            micro_batch_size=ids.shape[0],
            forward_only=True,
        )
        return stores[0]["logits"] if stores else None

    def forward_local(
        self, ids: torch.Tensor, phase: Generating, pick: torch.Tensor
    ) -> torch.Tensor:
        """`forward` of a model whole on this rank, without the pipeline schedule (what a CUDA
        graph captures); the model's parameters must be current (no pending gathers)."""
        positions = phase.locate(ids.shape[1]).T
        head = unwrap_model(self.model)(ids, positions, None, output_processor=output_head)
        return self._logits(head, pick)

    def _logits(self, head: Head, pick: torch.Tensor) -> torch.Tensor:
        """The picked rows' logits [B, V], gathered over TP, without the padding, in the model's
        dtype: the draw and its logprob widen them in their one pass, as `get_logprobs` widens
        its logits (an fp32 copy here was two more passes over [B, V] a step)."""
        rows = head.hidden.shape[0]
        hidden = head.hidden[torch.arange(rows, device=pick.device), pick]
        hidden = self.paths.generation.rows.pad(hidden)
        return full_logits(Head(hidden[:, None], head.weight), self.logits)[:rows, 0]


class _Run:
    """One generate call's state: what each row drew, and which rows are done."""

    def __init__(
        self,
        decoder: Decoder,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        limits: torch.Tensor,
        how: Sampling,
        stops: Stops,
        seed: int,
        row_ids: torch.Tensor,
    ) -> None:
        self.d, self.ids, self.how, self.stops = decoder, ids, how, stops
        self.lengths, self.limits = lengths, limits
        self.generator = torch.Generator(device=decoder.device).manual_seed(seed)
        self.row_ids = row_ids  # [B] on the device
        self.tokens: list[torch.Tensor] = []  # per step [B] on CPU
        self.logprobs: list[torch.Tensor] = []
        self.counts = torch.zeros_like(lengths)  # tokens drawn per row
        self.done = torch.zeros(len(lengths), dtype=torch.bool)
        self.stopped = torch.zeros_like(self.done)  # by a stop token or string
        self.route_rows: torch.Tensor | None = None
        self.stop_ids = torch.tensor(stops.token_ids, dtype=torch.long)

    def loop(self, phase: Generating) -> None:
        d, b, width = self.d, self.ids.shape[0], self.ids.shape[1]
        device, cache = d.device, phase.cache
        lengths = self.lengths.to(device)
        starts = torch.zeros(b, dtype=torch.long, device=device)
        phase.begin(Step(starts=starts, keys_used=width, prefill=True, lengths=lengths))
        padding = torch.arange(width, device=device)[None, :] >= lengths[:, None]
        logits = d.forward(self.ids, phase, lengths - 1, padding)
        self._record_routes(phase, (b, width))
        self._advance(logits)
        if d.local:
            self._decode_local(phase, lengths, width)
            return
        step = 1
        while self._any_active():
            feed = self.tokens[-1].to(device)[:, None]
            starts = torch.clamp(lengths + step - 1, max=cache.capacity - 1)
            phase.begin(Step(starts=starts, keys_used=cache.reach(width + step), prefill=False))
            done = self.done.to(device)[:, None]  # a done row's token is padding
            logits = d.forward(feed, phase, torch.zeros_like(starts), done)
            self._record_routes(phase, (b, 1))
            self._advance(logits)
            step += 1

    def _decode_local(self, phase: Generating, lengths: torch.Tensor, width: int) -> None:
        """The decode steps of a `local` model with the host one step behind: step s+1 is
        queued — fed step s's tokens on the device — before the host reads step s's draw back
        for its bookkeeping (stop tokens and strings, counts, which rows are done), so the
        device never waits for the host between steps. A done row is fed its own draw instead
        of padding: rows do not mix, and its output is padding either way. With `graphs` each
        forward is one replay of a CUDA graph captured at the first step. The step queued past
        the last row's end is dropped."""
        d, device, b, cache = self.d, self.d.device, self.ids.shape[0], phase.cache
        feed = self.tokens[-1][:, None].to(device, copy=True)  # written each step: not a view
        pick = torch.zeros_like(lengths)
        now = Step(starts=lengths.clone(), keys_used=cache.capacity, prefill=False)
        phase.begin(now)  # one step for every queued forward, its starts written in place
        pinned = device.type == "cuda"  # the draw's copy back must not block the host
        out = [torch.zeros(3, b, dtype=torch.float64, pin_memory=pinned) for _ in range(2)]
        graph: GraphedStep | None = None

        def queue(step: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
            nonlocal graph
            torch.clamp(lengths + step - 1, max=cache.capacity - 1, out=now.starts)
            if d.graphs:
                if graph is None:  # captured at the first step (its warm-up writes the same keys)
                    graph = GraphedStep(lambda: d.forward_local(feed, phase, pick))
                logits = graph.replay()
            else:
                now.keys_used = cache.reach(width + step)
                logits = d.forward_local(feed, phase, pick)
            draw = self._draw(logits)
            feed.copy_(draw[0, :, None])
            drawn = out[step % 2]  # step s-1's buffer was read before step s+1 is queued
            drawn[:2].copy_(draw, non_blocking=pinned)
            ready = torch.cuda.Event() if pinned else None
            if ready is not None:
                ready.record()
            return drawn, ready

        limit = int(((self.limits - self.counts) * ~self.done).max())  # steps any row may take
        step, pending = 1, (queue(1) if limit > 0 else None)
        while pending is not None:
            ahead = queue(step + 1) if step < limit else None
            drawn, ready = pending
            if ready is not None:
                ready.synchronize()
            self._mark(drawn)
            self._update(drawn)
            if not self._any_active():
                return
            step, pending = step + 1, ahead

    def _advance(self, logits: torch.Tensor | None) -> None:
        """Draw (last stage), share with every stage, update which rows are done."""
        b = self.ids.shape[0]
        drawn = torch.zeros(3, b, dtype=torch.float64)
        if logits is not None:
            drawn[:2] = self._draw(logits).cpu()  # one copy
            self._mark(drawn)
        drawn = broadcast_from_last_stage(drawn, self.d.groups, device=self.d.device)
        self._update(drawn)

    def _draw(self, logits: torch.Tensor) -> torch.Tensor:
        """One step's draw on the logits' device: [2, B] fp64, the tokens and their logprobs."""
        tokens, logprobs = next_tokens(logits, self.how, self.generator, self.row_ids)
        return torch.stack([tokens.double(), logprobs.double()])

    def _mark(self, drawn: torch.Tensor) -> None:
        """A draw [3, B] (tokens, logprobs, -): done rows' tokens become padding — on the host:
        a copy of `done` to the device would wait for the step before the draw could be
        queued — and row 2 says whose new token ends the row."""
        drawn[0] = torch.where(self.done, float(self.d.pad_id), drawn[0])
        drawn[2] = self._stops_now(drawn[0].long()).double()

    def _update(self, drawn: torch.Tensor) -> None:
        """Record a step's draw [3, B] (tokens, logprobs, stop) and which rows it finished."""
        tokens, logprobs, stop = drawn[0].long(), drawn[1].float(), drawn[2].bool()
        active = ~self.done
        self.tokens.append(tokens)
        self.logprobs.append(torch.where(active, logprobs, 0.0))
        self.counts += active.long()
        self.stopped |= active & stop
        self.done |= self.stopped | (self.counts >= self.limits)

    def _stops_now(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B] bool: the row's new token ends it (a stop token, or a stop string that ends in
        its decoded response's tail: the last tokens, as many as the longest string has
        characters and a few more — a string wholly before them would have stopped the row)."""
        stops = self.stops
        hit = torch.isin(tokens, self.stop_ids)
        if stops.decode is None:
            return hit
        for row in range(len(tokens)):
            words = stops.by_text(row)
            if words and not self.done[row] and not hit[row]:
                tail = min(int(self.counts[row]), max(map(len, words)) + 4)
                ids = [int(t[row]) for t in self.tokens[len(self.tokens) - tail :]]
                text = stops.decode([*ids, int(tokens[row])])
                hit[row] = any(w in text for w in words)
        return hit

    def _any_active(self) -> bool:
        active = bool((~self.done).any())  # host state: no device round trip per step
        # an expert-parallel forward exchanges tokens with every EP rank: step together
        if self.d.routers is not None and self.d.groups.ep_size > 1:
            flag = torch.tensor([int(active)], device=self.d.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.d.groups.dp)
            active = bool(flag.item())
        return active

    def _record_routes(self, phase: Generating, shape: tuple[int, int]) -> None:
        routers = self.d.routers
        if routers is None:
            return
        used = routers.recorded(shape).cpu()
        routers.end_forward()
        if self.route_rows is None:
            b = shape[0]
            capacity = phase.cache.capacity
            self.route_rows = torch.full((b, capacity, *used.shape[2:]), -1, dtype=torch.long)
        assert phase.step is not None
        starts = phase.step.starts.cpu()
        for j in range(shape[1]):
            self.route_rows[torch.arange(shape[0]), starts + j] = used[:, j]

    def result(self) -> BatchedDataDict:
        """The reference's generation keys (`Decoder.generate`), as wide as the longest row:
        never wider than the context, so the output is a batch `get_logprobs` takes."""
        b = self.ids.shape[0]
        drawn = torch.stack(self.tokens, dim=1)  # [B, steps]
        lps = torch.stack(self.logprobs, dim=1)
        width = int((self.lengths + self.counts).max())
        out_ids = torch.full((b, width), self.d.pad_id, dtype=torch.long)
        out_lp = torch.zeros(b, width)
        prompt = self.ids.cpu()
        for row in range(b):
            n, m = int(self.lengths[row]), int(self.counts[row])
            out_ids[row, :n] = prompt[row, :n]
            out_ids[row, n : n + m] = drawn[row, :m]
            out_lp[row, n : n + m] = lps[row, :m]
        out = BatchedDataDict(
            {
                "output_ids": out_ids,
                "logprobs": out_lp,
                "generation_lengths": self.counts.clone(),
                "unpadded_sequence_lengths": self.lengths + self.counts,
                "truncated": ~self.stopped,
            }
        )
        if self.route_rows is not None:
            out[ROUTES] = self._routes(width)
        return out

    def _routes(self, width: int) -> torch.Tensor:
        """[B, W, L, K]: -1 past each row's end and at its last token (never fed, so never
        routed; no logprob of the sequence depends on it), merged over pipeline stages."""
        assert self.route_rows is not None
        rows = self.route_rows[:, :width]
        if rows.shape[1] < width:
            pad = torch.full((rows.shape[0], width - rows.shape[1], *rows.shape[2:]), -1)
            rows = torch.cat([rows, pad], dim=1)
        ends = (self.lengths + self.counts - 1)[:, None]
        rows = rows.masked_fill((torch.arange(width)[None, :] >= ends)[..., None, None], -1)
        pp = self.d.groups.pp
        if pp is not None and dist.get_world_size(pp) > 1:
            merged = rows.to(self.d.device)
            dist.all_reduce(merged, op=dist.ReduceOp.MAX, group=pp)
            rows = merged.cpu()
        return rows


@contextlib.contextmanager
def _no_sequence_parallel(model: torch.nn.Module) -> Iterator[None]:
    """Sequence parallelism off for a generate call, back on after (megatron's toggle)."""
    config = get_model_config(model)
    if not config.sequence_parallel:
        yield
        return
    core = unwrap_model(model)  # megatron's toggle walks the GPTModel itself
    set_model_to_sequence_parallel(core, False)
    try:
        yield
    finally:
        set_model_to_sequence_parallel(core, True)


def stop_rows(data: BatchedDataDict) -> tuple[tuple[str, ...], ...] | None:
    """The batch's per-row stop strings, as tuples (None: no column)."""
    rows: Sequence[Sequence[str] | None] | None = data.get(STOP_STRINGS)
    return None if rows is None else tuple(tuple(r or ()) for r in rows)
