"""Attention kernels of one tile, with their log-sum-exp, as two torch custom ops.

Every attention in Megatron-MEMO (the trainer's core attention with and without context
parallelism, SPPO's cached blocks, METP's head groups) is a sum of tiles: blocks of queries
against blocks of keys, unmasked or causal (top-left aligned, square), merged by log-sum-exp in
forward and differentiated tile by tile against the row's final output and log-sum-exp in
backward (the flash-attention backward identity: with the row's own log-sum-exp a tile's
probabilities are exactly its share of the full softmax).

``memo_attention::tile_forward`` -> (out, lse) and ``memo_attention::tile_backward`` ->
(dq, dk, dv) take [b, heads, s, d] tensors (views of Megatron's [s, b, heads, d] layout are
fine) with K/V in ``groups`` query groups (GQA is never expanded outside the kernel). They are
custom ops for one reason: a trace of the trainer's own modules under FakeTensorMode sees each
tile as one op, whose fake rule allocates its outputs (out, the fp32 log-sum-exp [b, heads,
s_q]; dq/dk/dv) and never an s x s tensor, and whose CUDA kernels' other requests (workspaces,
split-KV accumulators, GQA's expanded K/V; FlashAttention-2's or cuDNN's, whichever the trace's
target GPU dispatches: :func:`declared_workspaces`) are stated here next to the dispatch
(:func:`forward_workspaces`, :func:`backward_workspaces`) and recorded by the trace's CUDA rules
(memo_ext.trace.cuda_rules). Live CPU runs allocate the same outputs.

Kernels, by device and dtype (:func:`kernel_for`):

* CPU: torch's flash-attention kernel for CPU (``_scaled_dot_product_flash_attention_for_cpu``
  and its backward), GQA native;
* CUDA, fp16/bf16, head dim a multiple of 8, where cuDNN's fused attention is faster (compute
  capability 9.0 and later, :func:`cuda_backend`) and takes the tile (:func:`cudnn_takes`):
  cuDNN's fused flash attention through ``aten._scaled_dot_product_cudnn_attention`` and its
  backward, GQA native ("cuda_cudnn"; see "cuDNN's fused attention" below);
* CUDA, fp16/bf16, head dim a multiple of 8 up to 256, otherwise: the ``flash-attn`` package
  (>= 2.7) when it is installed (GQA native), torch's own FlashAttention-2 build otherwise
  (``_scaled_dot_product_flash_attention``, K/V groups expanded inside the op) ("cuda_flash").
  Their arithmetic never runs here (no GPU; tests/gpu/ compares them with the explicit
  kernel); how they read their operands does, through tests/cuda_double.py's FlashKernelDouble
  (cuDNN's through its CudnnAttentionDouble);
* anything else, any tile with dropout, and ``--attention-backend unfused``: an explicit softmax
  in fp32 that materialises the tile's scores. Dropout regenerates its mask in backward from a
  per-tile seed.

The trainer's ``--attention-backend`` (Megatron-LM's spelling) sets the CUDA choice for the
whole process (:func:`set_attention_backend`): ``auto`` (the default) takes the fastest exact
kernel (cuDNN on Hopper and later, FlashAttention-2 before), ``flash`` FlashAttention-2,
``fused`` cuDNN, ``unfused`` the explicit kernel. FlashAttention-3/4 (flash-attn's hopper
build, ``flash_attn_interface``) are not dispatched: a documented gap (docs/attention.md).

cuDNN's fused attention, as PyTorch calls it (read in pytorch's
aten/src/ATen/native/transformers/cuda/attention.cu and attention_backward.cu,
aten/src/ATen/native/cudnn/MHA.cpp, sdp_utils.cpp, the generated autograd node
ScaledDotProductCudnnAttentionBackward0, and cudnn-frontend's
include/cudnn_frontend/node/scaled_dot_product_flash_attention.h):

* GQA: K and V go in with their own head count (``h_q % h_k == 0``, checked by cudnn-frontend);
  the backward allocates dK/dV with ``empty_like(key)``/``empty_like(value)``, so they come back
  in the group count. The per-query-head dK/dV of a GQA backward are virtual tensors inside the
  fused graph (dense inputs): nothing is allocated for them.
* Undefined arguments: the backward's ``attn_bias``, ``cum_seq_q`` and ``cum_seq_k`` are
  non-optional ``Tensor`` arguments; autograd passes undefined tensors there (the forward
  returns undefined cum_seq tensors; an absent bias is saved as undefined), and Python passes
  ``None``, which the binding turns into an undefined tensor. An *empty* tensor is defined: as
  ``attn_bias`` it is taken as a bias (and fails to expand), as ``cum_seq_q`` it selects the
  nested-tensor (ragged) kernel. So None it is.
* Strides: cuDNN is given every tensor's sizes and strides when its graph is built (only the
  last stride must be 1), but the built graph is cached per thread under a key of b, h, s_q,
  s_kv, d, dtype, causal, dropout, bias and the sizes and strides of q, k and v only. The
  strides of out, grad_out and the log-sum-exp are those of the call that built the graph;
  later calls with the same key are read with them whatever their own strides are. Hence:
  q/k/v go as they are (copied only when their last stride is not 1), out and grad_out with
  q's strides (:func:`_cudnn_output_strides`; the key holds them), the log-sum-exp as a
  contiguous [b, heads, s_q, 1]. Before cuDNN 9.5.1 the backward
  also needed grad_out's strides to equal out's, which this gives.
* The log-sum-exp: cuDNN's "Stats" output, fp32 ``[b, heads, s_q, 1]`` contiguous, the natural
  log of the row sums (the values of FA2's ``[b, heads, s_q]``; measured on an H200); the
  backward's graph validates it as 4-D with a unit last stride.
* Causal: cuDNN's causal mask is top-left aligned (cudnn-frontend ``set_causal_mask``),
  FlashAttention-2's bottom-right: the same on the square tiles every causal tile here is
  (a rectangular causal tile is refused, :func:`_cudnn_check_square`).
* ``max_q``/``max_k`` of the backward are used as the dense s_q/s_kv: the tile's own lengths.
* What it allocates: forward, the output (``empty_like(q)`` for d_v == d_qk: q's layout), the
  fp32 stats and two 0-d int64 dropout seed/offset tensors, plus cuDNN's workspace (cudnn-
  frontend's own part is empty without ALiBi); backward, dQ/dK/dV (``empty_like`` of q/k/v)
  and one workspace block from the caching allocator: cudnn-frontend's dQ accumulator
  ``[b, h_q, s_q, d]`` fp32 and softmax sum ``[b, h_q, s_q]`` fp32 (dense inputs, cuDNN >= 9,
  no bias gradient, non-deterministic), plus whatever the cuDNN engine itself asks for (not
  modelled; to be measured on a GPU). :func:`cudnn_backward_workspace_shape`.
* Limits (sdp_utils.cpp ``can_use_cudnn_attention``): cuDNN >= 9, compute capability 8.0-12.1,
  fp16/bf16, head dim a multiple of 8 and at most 128 (256 on sm90 with cuDNN >= 9.10),
  s_kv > 1, not under ``torch.use_deterministic_algorithms(True)`` (its backward is not
  deterministic).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch

#: FlashAttention-2 takes head dims that are multiples of 8, at most 256.
CUDA_FLASH_HEAD_DIM_MULTIPLE = 8
CUDA_FLASH_MAX_HEAD_DIM = 256

#: The values of the trainer's ``--attention-backend`` (Megatron-LM's spelling) this module
#: runs; Megatron-LM's fifth, ``local`` (megatron.core's own DotProductAttention), is refused
#: by the trainer (:data:`LOCAL_BACKEND_REFUSAL`).
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused")
LOCAL_BACKEND_REFUSAL = (
    "--attention-backend local selects megatron.core's own DotProductAttention in Megatron-LM "
    "(an s x s score tensor, no context parallelism), which Megatron-MEMO's core attention "
    "replaces; use --attention-backend unfused for the explicit kernel, or auto")
#: Compute capabilities PyTorch lets cuDNN's fused attention run on (sdp_utils.cpp,
#: check_cudnn_hardware_support: sm80 to sm121), and from which ``auto`` prefers it: Hopper,
#: where it measured 1.6-1.9x FlashAttention-2 forward+backward (one H200,
#: bench/results/gpu_evidence_h200.md). Not measured on Ampere (FA2 stays) or Blackwell.
CUDNN_MIN_CAPABILITY, CUDNN_MAX_CAPABILITY = (8, 0), (12, 1)
CUDNN_PREFERRED_FROM = (9, 0)
#: cuDNN's head-dim limit (sdp_utils.cpp check_cudnn_tensor_shapes): 128, 256 on sm90 from
#: cuDNN 9.10.0.
CUDNN_MAX_HEAD_DIM, CUDNN_MAX_HEAD_DIM_SM90 = 128, 256

_STATE = threading.local()
#: The process's ``--attention-backend`` (not per thread: autograd runs a CUDA backward on its
#: own device thread, and the ring's GPU check runs ranks as threads).
_PROCESS = {"backend": "auto"}


def set_attention_backend(backend: str) -> None:
    """The CUDA kernel choice of every thread of this process (``--attention-backend``)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(LOCAL_BACKEND_REFUSAL if backend == "local" else
                         f"--attention-backend {backend!r}: one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    _PROCESS["backend"] = backend


def attention_backend() -> str:
    """The process's ``--attention-backend`` (:func:`set_attention_backend`)."""
    return _PROCESS["backend"]


def cudnn_attention_available() -> bool:
    """This torch can run cuDNN's fused attention: a cuDNN >= 9 build with the aten op."""
    try:
        return (torch.backends.cudnn.is_available()
                and (torch.backends.cudnn.version() or 0) >= 90000
                and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"))
    except RuntimeError:
        return False


def cudnn_attention_op_exists() -> bool:
    """This torch release has the cuDNN attention ops (what a trace for a CUDA build of the
    same release assumes; every CUDA wheel bundles cuDNN 9)."""
    return hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")


def cuda_backend(capability: tuple[int, int], cudnn_available: bool, backend: str = "auto",
                 deterministic: bool = False) -> str:
    """The CUDA kernel of a GPU of ``capability`` for ``--attention-backend backend``:
    "cuda_cudnn", "cuda_flash" or "explicit" -- without a GPU, for the estimator's traces.
    ``auto``: cuDNN from :data:`CUDNN_PREFERRED_FROM` when this torch has it and the run is
    not deterministic, FlashAttention-2 otherwise. ``fused`` raises ValueError (one line,
    naming the flag) where cuDNN cannot run."""
    if backend not in ATTENTION_BACKENDS:
        set_attention_backend(backend)  # raises the one-line refusal
    capability = tuple(capability)
    usable = (cudnn_available and CUDNN_MIN_CAPABILITY <= capability <= CUDNN_MAX_CAPABILITY
              and not deterministic)
    if backend == "unfused":
        return "explicit"
    if backend == "flash":
        return "cuda_flash"
    if backend == "fused":
        if not usable:
            why = ("its backward is not deterministic; drop --deterministic-mode or use "
                   "--attention-backend flash" if deterministic else
                   f"it needs a torch with cuDNN >= 9 and a GPU of compute capability "
                   f"{'.'.join(map(str, CUDNN_MIN_CAPABILITY))} to "
                   f"{'.'.join(map(str, CUDNN_MAX_CAPABILITY))}, this is "
                   f"{'.'.join(map(str, capability))}"
                   f"{'' if cudnn_available else ' without cuDNN attention'}; use "
                   "--attention-backend auto or flash")
            raise ValueError(f"--attention-backend fused runs cuDNN's fused attention: {why}")
        return "cuda_cudnn"
    return "cuda_cudnn" if usable and capability >= CUDNN_PREFERRED_FROM else "cuda_flash"


def cudnn_takes(head_dim: int, key_length: Optional[int], capability: tuple[int, int],
                cudnn_version: Optional[int] = None) -> bool:
    """cuDNN's fused attention takes a tile of this head dim and key length on this GPU
    (sdp_utils.cpp's shape checks; ``cudnn_version`` None: a release of 9.10 or later, as
    torch >= 2.8's wheels bundle)."""
    limit = CUDNN_MAX_HEAD_DIM
    if tuple(capability) == (9, 0) and (cudnn_version is None or cudnn_version >= 91000):
        limit = CUDNN_MAX_HEAD_DIM_SM90
    return (head_dim % 8 == 0 and head_dim <= limit
            and (key_length is None or key_length > 1))


def _strictly_deterministic() -> bool:
    return (torch.are_deterministic_algorithms_enabled()
            and not torch.is_deterministic_algorithms_warn_only_enabled())


def kernel_for(query: torch.Tensor, dropout_p: float = 0.0,
               key_length: Optional[int] = None) -> str:
    """Which kernel runs a tile of ``query`` (and ``key_length`` keys): "cpu_flash",
    "cuda_cudnn", "cuda_flash" or "explicit". :func:`forced_kernel` overrides it (tests run
    the explicit and the CUDA paths on CPU); :func:`set_attention_backend` chooses among the
    CUDA kernels (a tile cuDNN does not take falls back to FlashAttention-2)."""
    forced = getattr(_STATE, "kernel", None)
    if forced is not None:
        return forced
    backend = _PROCESS["backend"]
    if dropout_p > 0 or backend == "unfused":
        return "explicit"
    if query.device.type == "cpu":
        return "cpu_flash"
    if query.device.type == "cuda" and fused_kernels_take(query.dtype, query.shape[-1]):
        capability = torch.cuda.get_device_capability(query.device)
        preferred = cuda_backend(capability, cudnn_attention_available(), backend,
                                 _strictly_deterministic())
        return cuda_kernel(query.dtype, query.shape[-1], key_length, dropout_p, preferred,
                           capability, torch.backends.cudnn.version())
    return "explicit"


@contextlib.contextmanager
def _thread_setting(name: str, value) -> Iterator[None]:
    saved = getattr(_STATE, name, None)
    setattr(_STATE, name, value)
    try:
        yield
    finally:
        setattr(_STATE, name, saved)


def forced_kernel(kernel: Optional[str]):
    """Run every tile of this thread with ``kernel`` (None: by device and dtype)."""
    return _thread_setting("kernel", kernel)


def declared_workspaces(enabled: bool = True, kernel: str = "cuda_flash",
                        capability: tuple[int, int] = CUDNN_PREFERRED_FROM):
    """Make a trace's CUDA rules (memo_ext.trace.cuda_rules) record the requests the CUDA
    ``kernel`` ("cuda_flash", "cuda_cudnn": :func:`cuda_backend` of the target GPU; "explicit":
    none) makes on a GPU of ``capability`` besides the tile ops' outputs
    (:func:`forward_workspaces`, :func:`backward_workspaces`); tools/trace.py turns it on unless
    --no-flash-workspace. A tile cuDNN does not take (:func:`cudnn_takes`) declares
    FlashAttention-2's, as the trainer would run it (:func:`cuda_kernel`). Off in training."""
    return _thread_setting("workspaces", (kernel, tuple(capability)) if enabled else None)


def workspaces_declared() -> Optional[tuple[str, tuple[int, int]]]:
    """(kernel, capability) of :func:`declared_workspaces`, None when it is off."""
    return getattr(_STATE, "workspaces", None) or None


def declared_tile_kernel(q: torch.Tensor, k: torch.Tensor, dropout_p: float) -> Optional[str]:
    """The CUDA kernel whose requests a trace records for a tile of ``q`` and ``k``: the one the
    GPU :func:`declared_workspaces` names runs it with (:func:`cuda_kernel`), None when
    nothing is declared."""
    declared = workspaces_declared()
    if declared is None:
        return None
    kernel, capability = declared
    return cuda_kernel(q.dtype, q.shape[-1], k.shape[-2], dropout_p, kernel, capability)


# ------------------------------------------------------------- the CUDA kernels' allocations
# Stated in memo_ext.attention.kernel_requests (re-exported here); the dispatch rule the trace
# applies to them is :func:`cuda_kernel`.
from memo_ext.attention.kernel_requests import (  # noqa: E402,F401  (re-exported)
    CUDNN_BACKWARD_WORKSPACE,
    SPLIT_KV_LSE_ACCUM,
    SPLIT_KV_OUT_ACCUM,
    KernelRequest,
    backward_workspaces,
    cudnn_backward_workspace_shape,
    flash_backward_workspace_shapes,
    forward_workspaces,
    padded_head_dim,
    split_kv_splits,
)


def installed_flash_attn() -> Optional[tuple[int, int]]:
    """(major, minor) of the flash-attn the CUDA path uses here, None for torch's own
    FlashAttention-2 build (flash-attn absent or older than 2.7)."""
    flash = _flash_attn()
    if flash is None:
        return None
    from flash_attn import __version__

    major, minor = (int(part) for part in __version__.split(".")[:2])
    return major, minor


def fused_kernels_take(dtype: torch.dtype, head_dim: int) -> bool:
    """A CUDA tile of this dtype and head dim can go to a fused kernel at all (fp16/bf16, head
    dim a multiple of 8); which one is :func:`cuda_kernel`'s choice."""
    return (dtype in (torch.float16, torch.bfloat16)
            and head_dim % CUDA_FLASH_HEAD_DIM_MULTIPLE == 0)


def cuda_kernel(dtype: torch.dtype, head_dim: int, key_length: Optional[int],
                dropout_p: float, preferred: str = "cuda_flash",
                capability: tuple[int, int] = CUDNN_PREFERRED_FROM,
                cudnn_version: Optional[int] = None) -> str:
    """The kernel a CUDA tile runs on a GPU of ``capability`` whose choice for the run
    (:func:`cuda_backend`) is ``preferred``: "cuda_cudnn" where cuDNN takes the tile
    (:func:`cudnn_takes`), else "cuda_flash" up to head dim 256, else "explicit" (also with
    dropout, fp32 and head dims not a multiple of 8). :func:`kernel_for`'s rule for CUDA
    tensors, and the trace's for its target GPU (:func:`declared_tile_kernel`)."""
    if dropout_p > 0 or preferred == "explicit" or not fused_kernels_take(dtype, head_dim):
        return "explicit"
    if preferred == "cuda_cudnn" and cudnn_takes(head_dim, key_length, capability,
                                                 cudnn_version):
        return "cuda_cudnn"
    if head_dim <= CUDA_FLASH_MAX_HEAD_DIM:
        return "cuda_flash"
    return "explicit"


# ----------------------------------------------------------------------------- the ops

@torch.library.custom_op("memo_attention::tile_forward", mutates_args=())
def tile_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                 dropout_p: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile: q [b, heads, s_q, d], k/v [b, groups, s_k, d] -> out [b, heads, s_q, d] (q's
    dtype) and lse [b, heads, s_q] (fp32)."""
    kernel = kernel_for(q, dropout_p, key_length=k.shape[-2])
    if kernel == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        # The CPU kernel lays its lse out as [b, s_q, heads]; the CUDA kernels' (and the fake
        # rule's) is a contiguous [b, heads, s_q]. Same layout here, so that a live CPU trace
        # sees what a CUDA run does with it (its backward copies a strided lse).
        return out, lse.float().contiguous()
    if kernel == "cuda_cudnn":
        return _cuda_cudnn_forward(q, k, v, scale, causal)
    if kernel == "cuda_flash":
        return _cuda_flash_forward(q, k, v, scale, causal)
    return _explicit_forward(q, k, v, scale, causal, dropout_p, seed)


@tile_forward.register_fake
def _(q, k, v, scale, causal, dropout_p, seed):
    batch, heads, seq_q, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, heads, seq_q), dtype=torch.float32)


@torch.library.custom_op("memo_attention::tile_backward", mutates_args=())
def tile_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool,
                  dropout_p: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of one tile given the row's final ``out`` and ``lse`` over all
    tiles. What the CUDA kernels allocate besides them is :func:`backward_workspaces`."""
    kernel = kernel_for(q, dropout_p, key_length=k.shape[-2])
    if kernel == "cpu_flash":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)
    elif kernel == "cuda_cudnn":
        grads = _cuda_cudnn_backward(grad_out, q, k, v, out, lse, scale, causal)
    elif kernel == "cuda_flash":
        grads = _cuda_flash_backward(grad_out, q, k, v, out, lse, scale, causal)
    else:
        grads = _explicit_backward(grad_out, q, k, v, out, lse, scale, causal, dropout_p, seed)
    return tuple(grads)


@tile_backward.register_fake
def _(grad_out, q, k, v, out, lse, scale, causal, dropout_p, seed):
    # dq/dk/dv: empty_like of q/k/v, as every CUDA kernel here allocates them (cuDNN's in q/k/v's
    # own layout, which _cuda_cudnn_backward passes on).
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


TILE_FORWARD_OP = "memo_attention.tile_forward.default"
TILE_BACKWARD_OP = "memo_attention.tile_backward.default"


def merge_into(output: torch.Tensor, lse: torch.Tensor, tile_output: torch.Tensor,
               tile_lse: torch.Tensor) -> None:
    """Log-sum-exp merge of one more tile into the running fp32 ``output`` and ``lse`` of the
    same rows, in place (online softmax)."""
    merged = torch.logaddexp(lse, tile_lse)
    output.mul_(torch.exp(lse - merged).unsqueeze(-1)).add_(
        tile_output.float() * torch.exp(tile_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


# ------------------------------------------------------------------------------ kernels

def _expand_groups(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    groups = tensor.shape[1]
    return tensor if groups == heads else tensor.repeat_interleave(heads // groups, dim=1)


def _sum_groups(grad: torch.Tensor, groups: int) -> torch.Tensor:
    batch, heads, seq, dim = grad.shape
    if groups == heads:
        return grad
    return grad.view(batch, groups, heads // groups, seq, dim).sum(dim=2)


def _flash_attn():
    """flash-attn's interface module when flash-attn >= 2.7 is installed (its
    ``_wrapped_flash_attn_forward``/``_backward`` take [b, s, heads, d] and GQA natively and
    return the log-sum-exp), else None: torch's own FlashAttention-2 build is used instead."""
    try:
        from flash_attn import __version__
        from flash_attn import flash_attn_interface
    except ImportError:
        return None
    major, minor = (int(part) for part in __version__.split(".")[:2])
    return flash_attn_interface if (major, minor) >= (2, 7) else None


def _cuda_flash_forward(q, k, v, scale, causal):
    flash = _flash_attn()
    if flash is not None:
        out, lse, _, _ = flash._wrapped_flash_attn_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.0,
            softmax_scale=scale, causal=causal, window_size_left=-1, window_size_right=-1,
            softcap=0.0, alibi_slopes=None, return_softmax=False)
        return out.transpose(1, 2), lse
    heads = q.shape[1]
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, _expand_groups(k, heads), _expand_groups(v, heads), 0.0, causal, False, scale=scale)
    return out, lse.float()


def _unit_last_stride(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a contiguous copy when its last dimension is strided (which mha_fwd and
    mha_bwd refuse)."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _cuda_flash_backward(grad_out, q, k, v, out, lse, scale, causal):
    # What the CUDA backward reads by raw pointer must be laid out as it assumes. mha_bwd
    # (flash_api.cpp in flash-attn's sources, and torch's copy of it in
    # aten/src/ATen/native/transformers/cuda/flash_attn) hands the kernel
    # softmax_lse.data_ptr() with no strides at all: flash_bwd_kernel.h indexes it as a
    # contiguous [b, heads, s_q] ((bidb * h + bidh) * seqlen_q + row). Our callers pass row
    # slices of the whole rows' lse (ring and SPPO tiles, tiles cut at document bounds) and
    # head slices (head chunks): with more than one head, or batch > 1, those are strided and
    # a GPU would read other rows' values, silently giving wrong dQ/dK/dV. Neither wrapper
    # fixes it: torch's _flash_attention_backward (attention_backward.cu) makes only grad_out
    # and out contiguous, flash-attn's _flash_attn_backward only copies dout/q/k/v/out whose
    # last dimension is strided. So the lse is made contiguous here (a copy of b*heads*s_q
    # floats only when it is a slice; Transformer Engine's context parallelism does the same).
    # q/k/v/out/grad_out are read with their batch, row and head strides; mha_bwd only needs
    # their last dimension unit-strided (it refuses them otherwise), which the layouts here
    # always are; _unit_last_stride keeps that true whatever a caller passes.
    lse = lse.contiguous()
    q, k, v, out, grad_out = (_unit_last_stride(t) for t in (q, k, v, out, grad_out))
    flash = _flash_attn()
    if flash is not None:
        grads = [torch.empty_like(t.transpose(1, 2)) for t in (q, k, v)]
        flash._wrapped_flash_attn_backward(
            grad_out.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            out.transpose(1, 2), lse, *grads, dropout_p=0.0, softmax_scale=scale, causal=causal,
            window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
            deterministic=False, rng_state=None)
        return tuple(g.transpose(1, 2) for g in grads)
    heads, groups = q.shape[1], k.shape[1]
    # Dense tiles: the cumulative lengths are undefined (None), as the forward returns them; an
    # empty tensor would select the variable-length kernel, which refuses a batch of -1 (seen on
    # an H100). No dropout, so the RNG state is never read.
    no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, _expand_groups(k, heads), _expand_groups(v, heads), out, lse, None, None,
        q.shape[-2], k.shape[-2], 0.0, causal, no_rng, no_rng, scale=scale)
    return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)


# cuDNN's fused attention ("cuda_cudnn"; the module docstring says what the upstream sources
# establish). Kept apart from the FlashAttention-2 functions above.

def _cudnn_check_square(q, k, causal: bool) -> None:
    """cuDNN's causal mask is top-left aligned, FlashAttention-2's bottom-right: they agree on
    square tiles only, which is what every causal tile here is."""
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"a causal tile must be square for cuDNN's top-left causal mask, got "
                         f"{q.shape[-2]} queries x {k.shape[-2]} keys")


def _cudnn_operand(tensor: torch.Tensor) -> torch.Tensor:
    """q, k or v as cuDNN takes it: its own strides (described to the graph, and part of the
    graph cache's key), copied only when its last dimension is strided (refused)."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _cudnn_output_strides(q: torch.Tensor) -> tuple[int, ...]:
    """The layout out and grad_out are passed in: q's own strides (q as passed to cuDNN, last
    stride 1), which the graph cache's key holds, so every call that finds a cached backward
    graph passes out/grad_out in the layout the graph was built for. The trainer's paths hold
    them so already (also a head chunk's slices, whose strides have gaps); any other layout is
    copied into a buffer of q's strides (for a sliced q, the span of its strides). An
    expanded q (a zero stride: out would overlap itself) gets contiguous ones instead."""
    if any(stride == 0 and size > 1 for size, stride in zip(q.shape, q.stride())):
        return tuple(torch.empty(q.shape, device="meta").stride())
    return tuple(q.stride())


def _cudnn_in_layout(tensor: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    if tuple(tensor.stride()) == strides:
        return tensor
    return torch.empty_strided(tensor.shape, strides, dtype=tensor.dtype,
                               device=tensor.device).copy_(tensor)


def _cudnn_backward_operands(grad_out, q, k, v, out, lse):
    """(grad_out, q, k, v, out, stats) as the cuDNN backward is called with them: q/k/v by
    :func:`_cudnn_operand`, out and grad_out in :func:`_cudnn_output_strides` of q, the
    row's log-sum-exp as a contiguous fp32 [b, heads, s_q, 1] (cuDNN's own Stats layout)."""
    q, k, v = (_cudnn_operand(t) for t in (q, k, v))
    if out.shape != q.shape or grad_out.shape != q.shape:
        raise ValueError(f"cuDNN tile: out {tuple(out.shape)} and grad_out "
                         f"{tuple(grad_out.shape)} must be shaped like q {tuple(q.shape)}")
    strides = _cudnn_output_strides(q)
    out, grad_out = (_cudnn_in_layout(t, strides) for t in (out, grad_out))
    stats = lse.float().contiguous().unsqueeze(-1)
    return grad_out, q, k, v, out, stats


def _cuda_cudnn_forward(q, k, v, scale, causal):
    """(out [b, heads, s_q, d] in q's layout, lse [b, heads, s_q] fp32 contiguous)."""
    _cudnn_check_square(q, k, causal)
    q, k, v = (_cudnn_operand(t) for t in (q, k, v))
    out, stats, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    # Stats is [b, heads, s_q, 1] (an older torch allocated [b, heads, s_q]): same values.
    return out, stats.reshape(q.shape[:3]).float().contiguous()


def _cuda_cudnn_backward(grad_out, q, k, v, out, lse, scale, causal):
    """(dq, dk, dv) in q/k/v's shapes and layouts; dk/dv in the K/V group count (GQA native).
    ``out`` and ``lse`` are the rows' merged output and log-sum-exp, as for every tile."""
    _cudnn_check_square(q, k, causal)
    grad_out, q, k, v, out, stats = _cudnn_backward_operands(grad_out, q, k, v, out, lse)
    # No dropout: the seed/offset are never read (autograd would pass the forward's 0-d ones).
    no_rng = torch.zeros((), dtype=torch.int64, device=q.device)
    # attn_bias, cum_seq_q, cum_seq_k: None -> undefined tensors (empty ones would be a bias
    # and the ragged kernel); max_q/max_k are the dense lengths the kernel uses.
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad_out, q, k, v, out, stats, no_rng, no_rng, None, None, None, q.shape[-2],
        k.shape[-2], 0.0, causal, scale=scale)
    return dq, dk, dv


def _explicit_probabilities(q, k, scale, causal, lse=None):
    """fp32 scores' probabilities [b, heads, s_q, s_k] and the rows' lse (given or computed)."""
    k = _expand_groups(k.float(), q.shape[1])
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    if causal:
        length = scores.shape[-1]
        scores = scores + torch.full((length, length), float("-inf"),
                                     device=scores.device).triu(1)
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)), lse


def _dropout_keep(shape, dropout_p: float, seed: int, device) -> torch.Tensor:
    """The tile's dropout scale: kept entries 1/(1-p), dropped 0, from the tile's own seed so
    backward regenerates the same mask."""
    generator = torch.Generator(device=device).manual_seed(seed)
    keep = torch.rand(shape, generator=generator, device=device) >= dropout_p
    return keep.float() / (1.0 - dropout_p)


def _explicit_forward(q, k, v, scale, causal, dropout_p, seed):
    probabilities, lse = _explicit_probabilities(q, k, scale, causal)
    if dropout_p > 0:
        probabilities = probabilities * _dropout_keep(probabilities.shape, dropout_p, seed,
                                                      q.device)
    out = torch.matmul(probabilities, _expand_groups(v.float(), q.shape[1]))
    return out.to(q.dtype), lse


def _explicit_backward(grad_out, q, k, v, out, lse, scale, causal, dropout_p, seed):
    heads, groups = q.shape[1], k.shape[1]
    probabilities, _ = _explicit_probabilities(q, k, scale, causal, lse)
    grad = grad_out.float()
    keys, values = _expand_groups(k.float(), heads), _expand_groups(v.float(), heads)
    grad_probabilities = torch.matmul(grad, values.transpose(-1, -2))
    dropped = probabilities
    if dropout_p > 0:
        keep = _dropout_keep(probabilities.shape, dropout_p, seed, q.device)
        dropped = probabilities * keep
        grad_probabilities = grad_probabilities * keep
    grad_value = torch.matmul(dropped.transpose(-1, -2), grad)
    # sum_j P_ij dP_ij = dO_i . O_i also with dropout (O is the dropped output).
    row_dot = (grad * out.float()).sum(-1, keepdim=True)
    grad_scores = probabilities * (grad_probabilities - row_dot) * scale
    return (torch.matmul(grad_scores, keys).to(q.dtype),
            _sum_groups(torch.matmul(grad_scores.transpose(-1, -2), q.float()), groups).to(k.dtype),
            _sum_groups(grad_value, groups).to(v.dtype))
