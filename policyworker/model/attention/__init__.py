"""Attention for megatron-core's `SelfAttention` without Transformer Engine, as small types.

    core.py      CoreAttention (megatron's core-attention slot): hands q, k, v to the phase
                 installed now (`Switch`); `Fresh` is the phase over a forward's own tokens
    layout.py    where the tokens sit (`Padded`, `Packed`, `Split` under CP) and the `Kernels`
                 protocol each layout calls
    kernels.py   `Exact` (CPU, fp32), `Flash` (a GPU in half precision), `ByRows`
                 (batch-invariant scoring)
    masked.py    a layer's softmax: `Causal` (the phase's kernels) or `Masked` (a sliding
                 window and/or learned sinks: gpt-oss), chosen when the layer is built
    rotary.py    RoPE with HF's frequencies
    cache.py     the KV cache: storage only
    cached.py    `Generating`, the phase over a KV cache, and its prefill/decode kernels

Which kernels each phase (train, score, prefill, decode) runs is chosen once, in
`model/paths.py`.
"""
