"""megatron-core 0.19's experts with biases (`add_bias_linear`: gpt-oss), made to train, and
their biases' gradients right under sequence parallelism. Two fixes in `RowParallelLinear`:

1. An expert's `linear_fc2` (a RowParallelLinear) returns its output through
`reduce_from_tensor_model_parallel_region` where its group has one rank — the identity, but an
autograd Function that hands back its input — and `MLP.forward` then adds the expert's bias,
scaled by the router weight, in place on it; autograd refuses an in-place change of such a view.
With more ranks or expert parallelism megatron already takes the "explicit expert comm" path
(no reduce: the dispatcher combines). `install()` takes that path on one rank too, where the
reduce it skips is the identity.
2. An expert's fc2 bias is tagged `sequence_parallel` like any row-parallel bias, so
   `finalize_model_grads` sums its gradient over TP — after DDP summed it over the expert
   data-parallel group, which already holds the TP ranks (each computed its own tokens): the
   gradient came out doubled under TP2 + SP (measured: the grad norm off by 5e-5 relative).
   An expert's bias is not tagged.

Active only for biased experts (expert TP 1: `hf_config.check_layout`); idempotent.
"""

from __future__ import annotations

from typing import Any

from policyworker.compat.version import require_mcore

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.utils import get_pg_size

    require_mcore("expert_bias", "RowParallelLinear.explicit_expert_comm and MLP.forward's bias")
    init = RowParallelLinear.__init__

    def __init__(self: RowParallelLinear, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if not self.is_expert or self.bias is None:
            return
        self.bias.sequence_parallel = False
        if get_pg_size(self.tp_group) == 1:
            self.explicit_expert_comm = True

    RowParallelLinear.__init__ = __init__  # type: ignore[method-assign]
    _installed = True
