"""Every forward path of a model, chosen in one place when the worker is built (`choose_paths`).

A model runs in three phases: training (with gradient), scoring (`get_logprobs`, top-k,
reference logprobs, calibration) and generating (a prefill, then decode steps over a KV cache).
Each phase's attention is an object chosen here from the device, the dtype and the config;
the service that runs a phase installs it (`ForwardPaths.scoring`, `.generating`), training is
the resting phase. `batch_invariant` is one choice made here too: the scoring and prefill
attention row by row, the decode step's attention in one split, and generation's matmuls on at
least `MIN_ROWS` rows (`model/batch_invariant.py`) — so a generation's logprobs are bitwise its
scores.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from policyworker.model.attention.cache import KVCache
from policyworker.model.attention.cached import (
    CachedKernel,
    CacheWrite,
    FusedWrite,
    Generating,
    PlainWrite,
    invariant_decode,
    rows_prefill,
    sdpa_decode,
    sdpa_prefill,
    triton_decode,
)
from policyworker.model.attention.core import CoreAttention, Fresh, Phase, Switch
from policyworker.model.attention.kernels import ByRows, Exact, Flash
from policyworker.model.attention.latent_cache import LatentCache, LatentGenerating, LatentLayer
from policyworker.model.attention.layout import Kernels
from policyworker.model.attention.masked import Masked
from policyworker.model.attention.rotary import Rotary, Rotate, rotate_for
from policyworker.model.attention.sink_flash import VarlenFlash
from policyworker.model.batch_invariant import AnyRows, MinRows, Rows
from policyworker.model.chunked_mlp import ChunkedMLP, set_chunk
from policyworker.model.linear_attention import Cached, GatedDeltaNet, Mixing, StateCache, Whole
from policyworker.model.rope_scaling import RopeFrequencies
from policyworker.ops.compiled import triton_on
from policyworker.ops.gated_delta import DeltaRule, FlaRule, TorchRule, fla_installed


@dataclass(frozen=True, slots=True, kw_only=True)
class Generation:
    """What a generate call runs: the prefill's and a decode step's attention over the cache,
    how new keys reach the cache, and the rows its matmuls run on."""

    prefill: CachedKernel
    decode: CachedKernel
    write: CacheWrite
    rows: Rows


class ForwardPaths:
    """One model's phases. `install` wires them into a built model's attention layers."""

    def __init__(
        self,
        *,
        train: Kernels,
        score: Kernels,
        generation: Generation,
        rotate: Rotate,
        dtype: torch.dtype,
        delta_rule: DeltaRule,
        sink_flash: bool = False,
    ) -> None:
        self.training = Fresh(train, in_place=False)
        self.score = Fresh(score, in_place=True)
        self.generation = generation
        self.rotary = Rotary(rotate)
        """RoPE's frequencies for generation's positions (every layer has the same)."""
        self.dtype = dtype
        self.switch: Switch[Phase] = Switch(self.training)
        self.mlps: list[ChunkedMLP] = []
        self.latents: dict[int, LatentLayer] = {}
        """Latent attention's layers by layer number: generation caches their latents."""
        self.mlp_chunk_tokens: int | None = None
        """The dense MLPs' chunk while scoring or generating (`logprob_chunk_size`); training
        runs them whole."""
        self.mixing: Switch[Mixing] = Switch(Whole(delta_rule))
        self.sink_flash = sink_flash
        """Windows and sinks (`attention/masked.Masked`) train and score on flash attention."""
        """How every Gated DeltaNet layer runs its recurrence now (`model/linear_attention.py`)."""

    def install(
        self,
        model: torch.nn.Module,
        rope: RopeFrequencies,
        device: torch.device,
        mlp_chunk_tokens: int | None,
    ) -> None:
        """Every core attention of `model` runs this object's phases, with RoPE at `rope`'s
        frequencies (on `device`); its dense MLPs run `mlp_chunk_tokens` tokens at a time while
        scoring or generating."""
        inv_freq = rope.inv_freq.to(device)
        self.rotary.set_frequencies(inv_freq, rope.attention_factor)
        for module in model.modules():
            if isinstance(module, CoreAttention):  # a Rotary each: its own hooks (FP8 scales)
                module.rotary.set_frequencies(inv_freq, rope.attention_factor)
                module.rotary.rotate = self.rotary.rotate
                module.switch = self.switch
                if isinstance(module.softmax, Masked) and self.sink_flash:
                    module.softmax.on_flash(VarlenFlash())
            elif isinstance(module, MLASelfAttention):
                self.latents[module.core_attention.number] = LatentLayer.of(module)
            elif isinstance(module, ChunkedMLP):
                self.mlps.append(module)
            elif isinstance(module, GatedDeltaNet):
                module.mixing = self.mixing
        self.mlp_chunk_tokens = mlp_chunk_tokens

    @contextlib.contextmanager
    def scoring(self) -> Iterator[None]:
        """The scoring phase until exit."""
        with self.switch.using(self.score), self._chunked():
            yield

    @contextlib.contextmanager
    def generating(self, model: torch.nn.Module, capacity: int) -> Iterator[Generating]:
        """The generating phase over a fresh KV cache of `capacity` positions per row, and
        generation's matmul rows, until exit (the cache is dropped then)."""
        g = self.generation
        if self.latents:  # latent attention: a cache of latents (`attention/latent_cache.py`)
            phase: Generating = LatentGenerating(
                LatentCache(capacity), self.latents, g.prefill, self.rotary, self.dtype
            )
        else:
            phase = Generating(
                KVCache(capacity), g.prefill, g.decode, g.write, self.rotary, self.dtype
            )
        with contextlib.ExitStack() as stack:
            for layer in self.latents.values():
                stack.enter_context(layer.capturing())
            # the Gated DeltaNet layers' windows and states (a model without them: never read)
            stack.enter_context(self.mixing.using(Cached(StateCache(), phase)))
            with self.switch.using(phase), g.rows.around(model), self._chunked():
                yield phase

    @contextlib.contextmanager
    def _chunked(self) -> Iterator[None]:
        """The dense MLPs chunked until exit (they keep nothing for a backward then)."""
        set_chunk(self.mlps, self.mlp_chunk_tokens)
        try:
            yield
        finally:
            set_chunk(self.mlps, None)


def choose_paths(
    device: torch.device,
    dtype: torch.dtype,
    *,
    batch_invariant: bool,
    decode_attention: str,
    rotary_dim: int = 0,
    rotary_offset: int = 0,
    widths_differ: bool = False,
    experts: bool = False,
) -> ForwardPaths:
    """The kernels of every phase: exact SDPA paths on the CPU and in fp32, the GPU's half
    precision kernels in bf16/fp16; `batch_invariant` (where our Triton kernels run) scores and
    prefills row by row and decodes in one split; `decode_attention` ("sdpa" or "triton", where
    Triton runs) otherwise picks the decode step's kernel; `rotary_dim` from `rotary_offset`
    (partial RoPE: so many of each head's features; 0: all) the rotation, and the cache write
    that fuses RoPE only where it rotates whole heads; `widths_differ` (MLA: a head's value is
    narrower than its key) SDPA where our Triton kernels read one width (MLA's generation
    attends over its latents: `install` finds its layers, `attention/latent_cache.py`).
    `experts` (a mixture-of-experts model): `batch_invariant` is refused — each expert's GEMMs
    run on the rows the router sends it, so a token's bits depend on its neighbours (measured:
    1 of 21 tokens differed by 4.8e-7 for Qwen3-MoE and GLM-4.5 in Triton's interpreter)."""
    if experts and batch_invariant:
        raise ValueError(
            "batch_invariant: not supported yet with mixture-of-experts models (an expert's GEMMs "
            "run on as many rows as the router sends it: a token's bits depend on the batch)"
        )
    if widths_differ and batch_invariant:
        raise ValueError(
            "batch_invariant: not supported yet with multi-head latent attention (its decode "
            "kernel reads keys and values of one width)"
        )
    triton = triton_on(device) and not widths_differ
    half_on_gpu = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    train: Kernels = Flash() if half_on_gpu else Exact()
    invariant = batch_invariant and triton
    decode: CachedKernel = triton_decode if decode_attention == "triton" and triton else sdpa_decode
    generation = Generation(
        prefill=rows_prefill if invariant else sdpa_prefill,
        decode=invariant_decode if invariant else decode,
        write=FusedWrite() if triton and not rotary_dim else PlainWrite(),
        rows=MinRows() if batch_invariant else AnyRows(),
    )
    score = ByRows() if invariant else train
    rotate = rotate_for(device, rotary_dim, rotary_offset)
    # the gated delta rule: flash-linear-attention's kernels where the attention takes the
    # GPU's half-precision kernels too and fla-core is installed; else ours (exact)
    rule: DeltaRule = FlaRule() if half_on_gpu and fla_installed() else TorchRule()
    return ForwardPaths(
        train=train, score=score, generation=generation, rotate=rotate, dtype=dtype,
        delta_rule=rule, sink_flash=half_on_gpu and not invariant,
    )  # fmt: skip
