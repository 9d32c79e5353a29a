"""The packed (THD) attention path equals the padded path, sequence by sequence."""

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from policyworker.model.attention.kernels import (
    bucketed_length,
    causal_sdpa,
    one_sequence,
    varlen_reference,
)


def test_thd_reference_matches_per_sequence_padded_sdpa():
    torch.manual_seed(0)
    heads, groups, dim = 4, 2, 8
    lengths = [5, 1, 9, 3]
    total = sum(lengths) + 2  # trailing padding tokens
    q = torch.randn(total, heads, dim)
    k = torch.randn(total, groups, dim)
    v = torch.randn(total, groups, dim)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out = varlen_reference(q, k, v, cu, scale=dim**-0.5)
    for start, n in zip(cu[:-1].tolist(), lengths, strict=True):
        qs, ks, vs = (x[start : start + n].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(2, 0), vs.repeat_interleave(2, 0)
        scores = (qs @ ks.transpose(-1, -2)) * dim**-0.5
        scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
        ref = scores.softmax(-1) @ vs
        assert torch.allclose(out[start : start + n], ref.transpose(0, 1), atol=1e-6)
    assert (out[sum(lengths) :] == 0).all()
    assert PackedSeqParams(qkv_format="thd").qkv_format == "thd"


def test_bucketed_lengths_are_few_and_close():
    assert [bucketed_length(s) for s in (1, 2, 3, 5, 600, 1024, 1025, 16384, 16385)] == [
        1, 2, 4, 8, 1024, 1024, 2048, 16384, 17408,
    ]  # fmt: skip
    lengths = range(1024, 65537)
    assert len({bucketed_length(s) for s in lengths}) == 64  # 1024, 2048, ..., 65536
    assert all(0 <= bucketed_length(s) - s < 1024 for s in lengths)


def test_bucketed_causal_sdpa_equals_plain_values_and_gradients():
    """Padding the sequence to its bucket changes nothing a real token sees, forward or back
    (the GPU's one-row packs and padded batches take this path; here on the CPU, in fp32)."""
    torch.manual_seed(0)
    s = 1100  # bucket 2048: almost half of the padded row is padding
    q, k, v = (torch.randn(2, h, s, 8, requires_grad=True) for h in (4, 2, 2))
    plain = causal_sdpa(q, k, v, 0.3)
    grads = torch.autograd.grad(plain.square().sum(), (q, k, v))
    padded = causal_sdpa(q, k, v, 0.3, bucketed=True)
    assert padded.shape == plain.shape
    torch.testing.assert_close(padded, plain, rtol=0, atol=1e-6)
    for a, b in zip(torch.autograd.grad(padded.square().sum(), (q, k, v)), grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_one_sequence_pack_equals_thevarlen_reference():
    torch.manual_seed(0)
    t = 300
    q, k, v = (torch.randn(t, h, 8) for h in (4, 2, 2))
    cu = torch.tensor([0, t])
    want = varlen_reference(q, k, v, cu, 0.3)
    torch.testing.assert_close(one_sequence(q, k, v, 0.3), want, rtol=0, atol=1e-6)


def test_packed_forward_through_megatron_matches_padded(llama_dir):
    from conftest import make_worker

    worker = make_worker(llama_dir)
    model = worker.state.model.eval()
    dev = worker.device
    torch.manual_seed(1)
    lengths = [7, 3, 10]
    seqs = [torch.randint(0, 101, (n,), device=dev) for n in lengths]
    cu = torch.tensor([0, 7, 10, 20], dtype=torch.int32, device=dev)
    ids = torch.cat(seqs)[None, :]  # [1, T]
    pos = torch.cat([torch.arange(n, device=dev) for n in lengths])[None, :]
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=10, max_seqlen_kv=10
    )
    with torch.no_grad():
        packed = model(ids, pos, None, packed_seq_params=params)[0]  # [T, V]
        for s, start in zip(seqs, cu[:-1].tolist(), strict=True):
            alone = model(s[None, :], torch.arange(len(s), device=dev)[None, :], None)[0]
            assert (packed[start : start + len(s)] - alone).abs().max() <= 1e-5


def test_the_context_plans_varlen_description_is_the_block_attention():
    """What the GPU's one flash call is given — each query block's keys gathered one block
    after another (`key_index`, `cu_q`, `cu_k`), attended causally with the mask aligned to the
    lower right, as flash does for fewer queries than keys — equals the exact per-block path,
    for both ranks of CP=2 over three packed sequences; and the RoPE positions are each local
    token's position in its sequence."""
    from policyworker.model.attention.kernels import context_blocks_reference
    from policyworker.parallel.context import ContextSplit, local_positions

    padded, dim = (8, 4, 12), 8
    torch.manual_seed(0)
    key, value = torch.randn(24, 2, dim), torch.randn(24, 2, dim)
    for rank in (0, 1):
        split = ContextSplit(rank=rank, size=2, group=None, padded=padded)  # type: ignore[arg-type]
        plan = split.plan(torch.device("cpu"))
        query = torch.randn(12, 4, dim)
        want = context_blocks_reference(query, key, value, plan, dim**-0.5)
        k_all, v_all = key[plan.key_index], value[plan.key_index]
        cu_q, cu_k = plan.cu_q.tolist(), plan.cu_k.tolist()
        for j in range(len(plan.blocks)):
            q = query[cu_q[j] : cu_q[j + 1]].transpose(0, 1)
            k, v = (x[cu_k[j] : cu_k[j + 1]].transpose(0, 1) for x in (k_all, v_all))
            n_q, n_k = q.shape[1], k.shape[1]
            lower_right = torch.ones(n_q, n_k).tril(n_k - n_q).bool()
            got = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=lower_right, scale=dim**-0.5, enable_gqa=True
            )
            torch.testing.assert_close(got.transpose(0, 1), want[cu_q[j] : cu_q[j + 1]])
        whole = torch.arange(24) - torch.tensor([0] * 8 + [8] * 4 + [12] * 12)
        assert torch.equal(plan.positions, whole[local_positions(list(padded), rank, 2)])
