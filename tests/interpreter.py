"""Run Triton kernels in Triton's interpreter (on the CPU, numpy): import this module first, in a
process started with TRITON_INTERPRET=1 (Triton reads it when a kernel is defined).

Triton 3.6's interpreter turns a loaded scalar (a one-element array) into a Python int with
int(array), which numpy 2 refuses for arrays of one dimension: a loop bound read from memory
fails. The kernels are fine on a GPU; here the conversion takes the element.
"""

from __future__ import annotations

import os

import triton.runtime.interpreter as _interpreter

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

_patch = _interpreter._patch_lang_tensor


def _patched(tensor, scope):  # type: ignore[no-untyped-def]
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))


_interpreter._patch_lang_tensor = _patched
