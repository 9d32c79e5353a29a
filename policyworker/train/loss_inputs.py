"""A loss's inputs from one micro-batch's logits (`loss_inputs`): the one place they are taken from
the last stage's `Head` — token logprobs, index logprobs, entropy, the reverse KL to a teacher —
in one chunked pass over the logits, as [n, S] rows of the micro-batch's data."""

from __future__ import annotations

import torch

from policyworker.data.microbatch import Microbatch
from policyworker.losses.common import LossInputs, LossNeeds
from policyworker.ops.kl import reverse_kl
from policyworker.ops.logprobs import Head, LogitOptions, logprobs_at
from policyworker.train.teacher import TeacherHeads


def loss_inputs(
    head: Head,
    mb: Microbatch,
    needs: LossNeeds,
    opts: LogitOptions,
    teachers: TeacherHeads | None = None,
) -> LossInputs:
    """What `needs` asks for, from one micro-batch's logits, as [n, S] rows of `mb.data`: one
    chunked pass over the logits picks the next tokens' and the index ids' logprobs together;
    a full-vocabulary KL (against `teachers`' heads for a hidden-state payload) is another."""
    whole = mb.pack(mb.data["input_ids"])  # the whole sequence, [b, T] (or padded [n, S])
    parts = [whole[..., None][..., :0]]  # none: the entropy alone
    if needs.logprobs:
        parts.append(torch.cat([whole[:, 1:], torch.zeros_like(whole[:, :1])], dim=1)[..., None])
    if needs.index_key is not None:
        parts.append(mb.pack(mb.data[needs.index_key]))
    logprobs = at_ids = entropy = kl = None
    if len(parts) > 1 or needs.entropy:
        ids = mb.to_local(torch.cat(parts, dim=-1))
        picked, ent = logprobs_at(head, ids, opts, entropy=needs.entropy)
        picked = mb.gather(picked)  # [b, T, 1 + k] of the whole sequence
        if needs.logprobs:
            # log p(next token) at i, moved to i+1, then to rows; packed, a row's position 0
            # read the previous row's last logits: 0 by definition
            raw = picked[..., 0]
            lp = mb.unpack(torch.cat([torch.zeros_like(raw[:, :1]), raw[:, :-1]], dim=1))
            logprobs = torch.cat([lp.new_zeros(lp.shape[0], 1), lp[:, 1:]], dim=1)
        if needs.index_key is not None:
            at_ids = mb.unpack(picked[..., int(needs.logprobs) :])
        if ent is not None:
            entropy = mb.unpack(mb.gather(ent))
    if needs.teacher_payload is not None:
        assert teachers is not None
        rows = teachers.rows(mb, needs.teacher_payload, head.hidden.device)
        kl = mb.unpack(mb.gather(reverse_kl(head, rows, opts)))
    return LossInputs(logprobs=logprobs, entropy=entropy, index_logprobs=at_ids, reverse_kl=kl)
