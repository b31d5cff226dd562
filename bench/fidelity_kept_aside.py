"""The kept-aside program of bench/trace_fidelity.py: checked the same way as the others (its
real CUDA snapshot against our fake-tensor recording of the same step), but never used to tune
our rules.

Wedsonlin/assignment2-systems @ 8630bcf, ``cs336_systems/nsys_profile.py`` run by
``scripts/run_profile_configs.sh --size medium --context-length 512 --memory-profile true
--pattern full-training-step --autocast true`` (autocast: the script's default is off; the
trace's bf16 einsum outputs say it was on): the vendored cs336-basics BasicsTransformerLM
(24 layers, d_model 1024, d_ff 4096, 16 heads, RoPE theta 10000, context 512, vocab 10000,
untied lm_head), fp32 parameters, the vendored AdamW (lr 1e-3, weight decay 0.01), batch 4, the
vendored cross_entropy; forward and loss under ``torch.autocast("cuda", torch.bfloat16)``,
backward and step outside it. 5 warm-up steps (forward, loss, backward, step, zero_grad()),
then ``del output, loss``, ``zero_grad(set_to_none=True)``, and the recording covers one full
step (forward, loss, backward, optimizer.step(); no zero_grad). Committed snapshot:
results/medium_512_training_memory_snapshot.pickle (../shared/data/snapshots/
transformer_medium_ctx512_train_warm.pickle is the same file).

The snapshot was recorded with autocast on (bf16 einsum outputs; ``exp``/``log`` of bf16
inputs cast to fp32 first: the CUDA autocast lists). CPU autocast has other lists (on CPU
``exp`` stays bf16 and ``einsum`` is not cast at its entry), and fake CUDA tensors cannot run
autograd on a CPU-only build, so :func:`_cuda_autocast` runs CPU autocast with the CUDA
policies of the ops this model reaches registered as AutocastCPU kernels for the duration.
"""

from __future__ import annotations

import contextlib
import types
from pathlib import Path

import torch

from trace_fidelity import Program, _imported_from, _jaxtyping_stub, _no_value_init

# ------------------------------------------------------------------------------ CUDA autocast

#: aten/src/ATen/autocast_mode.h, CUDA: AT_FORALL_FP32 (inputs cast to fp32), the elementwise
#: entries; AT_FORALL_FP32_SET_OPT_DTYPE (an unset ``dtype`` becomes fp32), those whose dtype
#: argument is keyword-only. einsum is in CUDA's lower-precision list, not in CPU's (the
#: snapshot's casts come from at::autocast::WrapFunction_ around at::_ops::einsum::call).
_CUDA_FP32 = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
              "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
              "pow.Scalar", "softplus")
_CUDA_FP32_SET_OPT_DTYPE = ("sum", "sum.dim_IntList", "prod", "prod.dim_int", "cumsum")
_CUDA_LOWER_PRECISION = ("einsum",)


def _eligible(value) -> bool:
    """autocast's is_eligible: a floating tensor other than fp64."""
    return (isinstance(value, torch.Tensor) and value.is_floating_point()
            and value.dtype != torch.float64)


@contextlib.contextmanager
def _cuda_autocast(dtype: torch.dtype, enabled: bool = True):
    """``torch.autocast("cuda", dtype, enabled)`` for CPU (fake) tensors: CPU autocast, with
    CUDA's policy for the ops in the lists above as AutocastCPU kernels (removed on exit).
    Lower precision: floating inputs cast to ``dtype``, fp32 leaf tensors that require grad
    (parameters) through a cache cleared on exit (autocast_mode.cpp cached_cast); fp32: fp16/
    bf16 inputs cast to fp32; set_opt_dtype: ``dtype=float32`` when unset and the first input
    is eligible. Of CPU autocast's own lists this model reaches only bmm, inside einsum, where
    autocast is excluded as in the CUDA wrapper."""
    if not enabled:
        yield
        return
    exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def cast(value, to):
        if not _eligible(value) or value.dtype == to:
            return value
        cacheable = (to == dtype and value.dtype == torch.float32 and value.requires_grad
                     and value.is_leaf and not value._is_view()
                     and torch.is_autocast_cache_enabled())
        if not cacheable:
            return value.to(to)
        if id(value) not in cache:
            cache[id(value)] = (value, value.to(to))
        return cache[id(value)][1]

    def cast_all(values, to):
        return [cast_all(v, to) if isinstance(v, (list, tuple)) else cast(v, to)
                for v in values]

    def lower_precision(op):
        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(exclude):
                return op(*cast_all(args, dtype), **kwargs)
        return kernel

    def fp32(op):
        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(exclude):
                return op(*cast_all(args, torch.float32), **kwargs)
        return kernel

    def fp32_set_opt_dtype(op):
        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(exclude):
                if kwargs.get("dtype") is None and _eligible(args[0]):
                    kwargs = dict(kwargs, dtype=torch.float32)
                return op(*args, **kwargs)
        return kernel

    library = torch.library.Library("aten", "IMPL")
    try:
        for names, policy in ((_CUDA_LOWER_PRECISION, lower_precision), (_CUDA_FP32, fp32),
                              (_CUDA_FP32_SET_OPT_DTYPE, fp32_set_opt_dtype)):
            for name in names:
                base, _, overload = name.partition(".")
                op = getattr(getattr(torch.ops.aten, base), overload or "default")
                library.impl(name, policy(op), "AutocastCPU")
        with torch.autocast(device_type="cpu", dtype=dtype):
            yield
    finally:
        cache.clear()
        library._destroy()


# ------------------------------------------------------------------------------ the program

def _einx_stub() -> types.ModuleType:
    """einx is used only by RotaryEmbedding with explicit token positions (never given)."""
    return types.ModuleType("einx")


def run_cs336_medium_bf16(checkout: Path, step, end) -> None:
    """cs336_systems/nsys_profile.py memory_profile(pattern="full-training-step",
    autocast=True) for the "medium" config at context 512 (module docstring). The model is
    built on the (fake) device directly: ``model.to(device)`` is a no-op here; initial values
    do not matter. The five warm-up steps run as in the program: the recording starts with
    optimizer state m, v in place and gradients set to None."""
    names = ("cs336_basics", "cs336_basics.model", "cs336_basics.nn_utils",
             "cs336_basics.optimizer")
    stubs = {"jaxtyping": _jaxtyping_stub(), "einx": _einx_stub()}
    with _imported_from(checkout / "cs336-basics", names, stubs) as (_, basics, nn_utils, optim):
        with _no_value_init():
            model = basics.BasicsTransformerLM(vocab_size=10000, context_length=512,
                                               d_model=1024, num_layers=24, num_heads=16,
                                               d_ff=4096)
        optimizer = optim.AdamW(model.parameters())
        cross_entropy = nn_utils.cross_entropy
        autocast = True
        warmup_steps = 5
        execution_steps = 1
        batch_size = 4
        vocab, context = model.config["vocab_size"], model.config["context_length"]
        warmup_inputs = torch.randint(low=0, high=vocab, size=(warmup_steps, batch_size, context),
                                      dtype=torch.long)
        execution_inputs = torch.randint(low=0, high=vocab,
                                         size=(execution_steps, batch_size, context),
                                         dtype=torch.long)
        warmup_targets = torch.randint(low=0, high=vocab,
                                       size=(warmup_steps, batch_size, context), dtype=torch.long)
        execution_targets = torch.randint(low=0, high=vocab,
                                          size=(execution_steps, batch_size, context),
                                          dtype=torch.long)
        model.train()
        for i in range(warmup_steps):
            with _cuda_autocast(torch.bfloat16, enabled=autocast):
                output = model(warmup_inputs[i])
                loss = cross_entropy(output, warmup_targets[i])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        del output, loss
        optimizer.zero_grad(set_to_none=True)
        step()
        with _cuda_autocast(torch.bfloat16, enabled=autocast):
            output = model(execution_inputs[0])
            loss = cross_entropy(output, execution_targets[0])
        loss.backward()
        optimizer.step()
        end()


KEPT_ASIDE = Program(
    name="cs336-medium-bf16",
    description="Wedsonlin/assignment2-systems @ 8630bcf (kept aside: not used to tune our "
    "rules): BasicsTransformerLM 24x1024 (d_ff 4096, 16 heads, ctx 512, vocab 10000), batch 4, "
    "fp32 parameters, forward and cross_entropy under bf16 autocast, AdamW; one full step after "
    "5 warm-up steps",
    snapshot="results/medium_512_training_memory_snapshot.pickle",
    files=("results/medium_512_training_memory_snapshot.pickle",
           "cs336-basics/cs336_basics/__init__.py", "cs336-basics/cs336_basics/model.py",
           "cs336-basics/cs336_basics/nn_utils.py", "cs336-basics/cs336_basics/optimizer.py",
           "cs336_systems/nsys_profile.py"),
    # uv.lock and both pyproject.toml files of that commit pin torch 2.11.0 (~=2.11.0); the
    # frames agree: module.py _wrapped_call_impl 1779 / _call_impl 1790, optimizer.py wrapper
    # 533 (torch 2.13: 1778 / 1789 / 530), python3.12 site-packages of a uv .venv
    snapshot_torch="2.11.0 (documented: uv.lock)",
    gpu=((8, 9), 128, "not recorded; inferred: bf16 autocast, over 23.45 GiB free (the "
         "commit's ctx-1024 snapshot reserved that much), fwd+bwd at ctx 1024 GPU-bound at "
         "about 0.5 s (several times an H100's): a 24 GiB Ada/Ampere card, RTX 4090 assumed; "
         "the window's reduction scratch is the same for any card of 22 SMs or more"),
    # ``output = model(execution_inputs[0])``: line 142 of the committed script and of the
    # recording's frames (the recording holds this one step: the window starts at event 0)
    step_file="nsys_profile.py", step_line=142, run=run_cs336_medium_bf16)
