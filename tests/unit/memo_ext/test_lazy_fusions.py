"""memo_ext.lazy_fusions: megatron-core's torch.compile decorations are made at the first call."""

from __future__ import annotations

import subprocess
import sys

import torch

from memo_ext.lazy_fusions import compile_on_first_call
from tests.conftest import subprocess_env

IMPORT_CHECK = """
import sys
import memo_ext, megatron.core, megatron.core.jit as jit
from megatron.core.fusions.fused_bias_gelu import bias_gelu
from memo_ext.lazy_fusions import compile_on_first_call
assert jit.jit_fuser is compile_on_first_call, jit.jit_fuser
assert bias_gelu.__wrapped__.__name__ == "bias_gelu"  # decorated by the deferring wrapper
# no decoration ran: inductor, which the first torch.compile call imports, is not loaded
assert "torch._inductor.compile_fx" not in sys.modules
"""


def test_megatron_core_imports_without_compiling_its_fusions():
    result = subprocess.run([sys.executable, "-c", IMPORT_CHECK], env=subprocess_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_first_call_compiles_with_the_decorations_options(monkeypatch):
    made = []
    real = torch.compile

    def recording(function, **options):
        made.append((function.__name__, options))
        return real(function, **options)

    monkeypatch.setattr(torch, "compile", recording)

    @compile_on_first_call(backend="eager", fullgraph=True)
    def scaled(x, factor=2.0):
        return x * factor + 1

    assert made == []
    x = torch.arange(4.0)
    assert torch.equal(scaled(x), x * 2 + 1)
    assert torch.equal(scaled(x, factor=3.0), x * 3 + 1)
    assert made == [("scaled", {"backend": "eager", "fullgraph": True})]  # once
    assert scaled.__name__ == "scaled"


def test_the_bare_decorator_form_compiles_too(monkeypatch):
    made = []
    monkeypatch.setattr(torch, "compile", lambda function, **options: made.append(options)
                        or function)

    @compile_on_first_call
    def plus_one(x):
        return x + 1

    assert plus_one(1) == 2 and plus_one(2) == 3
    assert made == [{}]
