"""compat/finalize: megatron's end-of-step module walk runs only where it can reset something."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

from policyworker.compat import finalize


class _Walked(Exception):
    pass


class _Model:
    """A model chunk whose submodule walk is observable."""

    def modules(self):
        raise _Walked


def _config(bias: bool = False, balancing: str | list[str] = "aux_loss") -> SimpleNamespace:
    return SimpleNamespace(
        moe_router_enable_expert_bias=bias, moe_router_load_balancing_type=balancing
    )


@pytest.mark.parametrize(
    ("config", "walks"),
    [
        (_config(), False),
        (_config(balancing="seq_aux_loss"), False),
        (_config(balancing="none"), False),
        (_config(bias=True), True),
        (_config(balancing="global_aux_loss"), True),
        (_config(balancing=["seq_aux_loss", "global_aux_loss"]), True),
        (_config(balancing="quantile_balancing"), True),
    ],
)
def test_the_walk_runs_only_where_it_can_find_something(config, walks):
    finalize.install()
    finalize.install()  # idempotent: one wrapper
    module = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    assert finalize.needs_reset(config) is walks
    if walks:
        with pytest.raises(_Walked):
            module.reset_model_temporary_tensors(config, [_Model()])
    else:
        module.reset_model_temporary_tensors(config, [_Model()])
