"""The worker's calls are declared once (`interface.PolicyCalls`): the worker implements every one
with that signature, each delegated call's service method takes its arguments by name, and the
driver offers the same calls with the same signatures and documentation."""

from __future__ import annotations

import inspect

from conftest import make_worker

from policyworker.driver.policy import Policy
from policyworker.interface import PolicyCalls
from policyworker.worker import MegatronPolicyWorker

CALLS = sorted(PolicyCalls.__abstractmethods__)


def _params(fn: object) -> list[tuple[str, object, object, object]]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    params = [(p.name, p.kind, p.default, p.annotation) for p in sig.parameters.values()]
    return [p[:3] if p[0] == "self" else p for p in params]  # `self`'s annotation: none needed


def test_the_worker_implements_every_call_with_its_declared_signature():
    assert not MegatronPolicyWorker.__abstractmethods__
    assert len(CALLS) > 40
    for name in CALLS:
        declared, ours = getattr(PolicyCalls, name), getattr(MegatronPolicyWorker, name)
        if isinstance(declared, property):
            assert isinstance(ours, property), name
            continue
        assert _params(ours) == _params(declared), name
        assert inspect.getdoc(ours) == inspect.getdoc(declared) and inspect.getdoc(ours), name


def test_every_delegated_call_reaches_a_method_that_takes_its_arguments(llama_dir):
    worker = make_worker(llama_dir)
    delegated = {n: getattr(MegatronPolicyWorker, n) for n in CALLS}
    delegated = {n: f.delegates_to for n, f in delegated.items() if hasattr(f, "delegates_to")}
    assert {"get_logprobs", "stream_weights_via_ipc_zmq", "generate"} <= delegated.keys()
    for name, path in delegated.items():
        target = worker
        for part in path.split("."):
            target = getattr(target, part)
        _, *names = inspect.signature(getattr(PolicyCalls, name)).parameters
        inspect.signature(target).bind(**dict.fromkeys(names))  # TypeError if one is missing


def test_the_driver_offers_the_same_calls():
    local = ("configure_worker", "use_reference_model", "weight_version", "export_hf_weights")
    skip = {"shutdown", "move_model", *local}  # a driver's own, or a call of one process only
    for name in CALLS:
        if name in skip or not hasattr(Policy, name):
            continue
        declared, driven = _params(getattr(PolicyCalls, name)), _params(getattr(Policy, name))
        assert [p[0] for p in driven[:-1]] == [p[0] for p in declared], name  # + `timer`
        assert getattr(Policy, name).__doc__ == getattr(PolicyCalls, name).__doc__, name
