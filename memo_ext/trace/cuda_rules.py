"""CUDA allocation rules: what a CUDA run of an aten op allocates that the same op on CPU or on
fake tensors does not (and the reverse), so a trace recorded on CPU makes the requests a GPU
run makes (docs/tracing.md, "CUDA allocation rules", has the table and the evidence).

Hand-written because no library models it: the allocations live inside PyTorch's CUDA kernels
(cuBLAS handle setup, operand copies, reduction scratch buffers) and inside autograd formulas
that take a different branch when a dispatch mode is active. Each rule names the PyTorch source
it encodes. Four kinds:

- *workspaces* (:meth:`CudaKernelRules.workspaces`): requests a CUDA kernel makes through the
  caching allocator besides its outputs -- the cuBLAS workspace at a thread's first GEMM,
  cuBLASLt's per-call workspace of older releases, copies of operands whose strides cuBLAS
  cannot take, the global-memory buffer of a reduction split across thread blocks, the
  embedding backward's sort temporaries, mse_loss's elementwise loss, and the attention tiles'
  CUDA kernels' workspaces (FlashAttention-2's or cuDNN's, as the target GPU dispatches them),
  split-KV accumulators and expanded K/V (stated in memo_ext.attention.kernels, next to the
  dispatch; recorded while ``kernels.declared_workspaces()`` is on);
- *sizes* (:meth:`CudaKernelRules.cuda_sizes`): outputs the CUDA kernel makes in another dtype
  (layer-norm statistics in fp32, dropout's bool mask);
- *kernel paths* (:func:`cuda_kernel_paths`): ops a CUDA build runs as one fused kernel where
  the CPU build decomposes them (``rms_norm``); while recording, CPU autograd takes the fused
  path too, so the recorder sees the fused kernel's outputs;
- *folds* (:meth:`CudaKernelRules.folds`): an out-of-place update that an autograd formula
  runs only because a dispatch mode is active (``at::isTensorSubclassLike`` is true for every
  tensor then, and the recorder *is* a dispatch mode) on zeros it made itself, where a CUDA run
  updates the zeros in place. The recorder makes the output the zeros' block.

The rules depend on the GPU (SM count, architecture) and the PyTorch release of the run a trace
stands for: :class:`CudaTarget`.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

from memo_ext.attention import kernels as attention_kernels
from memo_ext.hardware import HardwareProfileError, load_hardware
from memo_ext.trace.cuda_reduce import reduction_workspace

MiB = 1 << 20

#: The profile a trace stands for when none is named (the trace CLI's --gpu default).
DEFAULT_GPU = "h100"


def _installed_torch() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


@dataclass(frozen=True)
class CudaTarget:
    """The GPU and PyTorch release a trace stands for.

    ``cublas_workspace_bytes``: None takes PyTorch's default for the architecture
    (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize: CUBLAS_WORKSPACE_CONFIG
    ":4096:8" = 32 MiB on sm90, ":4096:2:16:8" = 8 MiB + 128 KiB otherwise); set it when the
    job sets CUBLAS_WORKSPACE_CONFIG.
    """

    compute_capability: tuple[int, int]
    sm_count: int
    torch_version: tuple[int, int] = field(default_factory=_installed_torch)
    cublas_workspace_bytes: Optional[int] = None
    #: The flash-attn release the attention tiles run (memo_ext.attention.kernels), None for
    #: torch's own FlashAttention-2 build: the installed one, as for torch.
    flash_attn: Optional[tuple[int, int]] = field(
        default_factory=attention_kernels.installed_flash_attn)

    @classmethod
    def for_gpu(cls, name: str = DEFAULT_GPU, hardware_file=None, **overrides) -> "CudaTarget":
        """The target of a GPU profile of memo_ext/hardware.json or of ``hardware_file`` (its
        ``compute_capability`` "9.0" and ``sm_count``), with the installed torch."""
        profile = load_hardware(name, hardware_file)
        try:
            major, minor = (int(x) for x in str(profile["compute_capability"]).split("."))
            sms = int(profile["sm_count"])
        except (KeyError, ValueError):
            raise HardwareProfileError(
                f"GPU profile {name!r}{f' in {hardware_file}' if hardware_file else ''} needs "
                '"compute_capability" ("8.0") and "sm_count" (108) for the CUDA allocation '
                "rules; add them") from None
        return cls(compute_capability=(major, minor), sm_count=sms, **overrides)

    @property
    def max_threads_per_sm(self) -> int:
        """cudaDeviceProp::maxThreadsPerMultiProcessor (CUDA C++ Programming Guide, compute
        capabilities table): 1536 on sm86/sm87/sm89, 2048 on sm80 and sm90."""
        return 1536 if self.compute_capability in ((8, 6), (8, 7), (8, 9)) else 2048

    @property
    def blas_workspace_bytes(self) -> int:
        if self.cublas_workspace_bytes is not None:
            return self.cublas_workspace_bytes
        return 32 * MiB if self.compute_capability[0] == 9 else 8 * MiB + 128 * 1024

    @property
    def fuses_rms_norm(self) -> bool:
        """rms_norm runs the fused CUDA kernel from torch 2.8, the first release whose
        layer_norm.cpp routes it to at::_fused_rms_norm; before, CUDA ran the composite too."""
        return self.torch_version >= (2, 8)

    @property
    def lt_workspace_per_call(self) -> bool:
        """Before 2.6 ``at::cuda::blas::gemm_and_bias`` allocated its cuBLASLt workspace
        (CUBLASLT_WORKSPACE_SIZE, 1 MiB) on every call and freed it on return (seen in a
        torch 2.4 snapshot: one 1 MiB request per biased linear). Since, it is cached per
        handle and stream, and shared with the cuBLAS workspace by default (2.10, pytorch
        #168175) -- no request of its own."""
        return self.torch_version < (2, 6)


#: The threads that run GEMMs: the caller's, and the autograd engine's device thread.
_BLAS_THREADS = ("main", "autograd")
_BLAS_WORKSPACE = "cuBLAS workspace (getCurrentCUDABlasHandle)"
#: The name of a reduction's scratch blocks (a trace's ``module``; the estimator's LinearTrace
#: does not extrapolate them).
REDUCTION_SCRATCH = "reduction scratch (gpu_reduce_kernel)"

#: Requests whose presence and size change in steps with the sequence length rather than along
#: a line: the reductions' scratch, and the flash forward's split-KV accumulators (tiles too
#: short to fill the GPU are split, longer ones not). memo_ext.estimate leaves them out of the
#: two-length line and keeps them as the longer trace has them.
STEPWISE_SCRATCH = frozenset({REDUCTION_SCRATCH, attention_kernels.SPLIT_KV_LSE_ACCUM,
                              attention_kernels.SPLIT_KV_OUT_ACCUM})

#: cuBLASLt's workspace of releases before 2.6 (the CUBLASLT_WORKSPACE_SIZE default).
LT_WORKSPACE_BYTES = 1 * MiB

_aten = torch.ops.aten
_HALF_TYPES = (torch.float16, torch.bfloat16)

#: Ops that fetch the current cuBLAS handle (at::cuda::getCurrentCUDABlasHandle), which binds
#: the per-(handle, stream) workspace on first use.
_BLAS_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten.mv.default, _aten.addmv.default, _aten.dot.default, _aten.addr.default,
    _aten._addmm_activation.default,
})
_MATRIX_OPS = {  # op -> indices of its two matrix operands
    _aten.mm.default: (0, 1), _aten.addmm.default: (1, 2),
    _aten._addmm_activation.default: (1, 2),
}
_BATCHED_OPS = {_aten.bmm.default: (0, 1), _aten.baddbmm.default: (1, 2)}

#: Reductions that run through gpu_reduce_kernel (aten/src/ATen/native/cuda/Reduce.cuh): op ->
#: index of its ``dim`` argument (None: all dims).
_REDUCTIONS = {
    _aten.sum.dim_IntList: 1, _aten.sum.default: None, _aten.mean.dim: 1,
    _aten.mean.default: None, _aten.amax.default: 1, _aten.amin.default: 1,
    _aten.max.dim: 1, _aten.min.dim: 1,
}
#: Reductions with a (value, int64 index) accumulator and two outputs (ReduceMinMaxKernel.cu).
_INDEXED_REDUCTIONS = (_aten.max.dim, _aten.min.dim)

#: Out-of-place ops an autograd formula runs when a dispatch mode is active, where CUDA runs
#: the in-place variant on zeros it made (torch/csrc/autograd/FunctionsManual.cpp):
#: - scatter.src / scatter.value: value_selecting_reduction_backward (max/min/median/kthvalue
#:   along a dim) scatters into fresh zeros with scatter_ unless a subclass-like tensor is
#:   involved;
#: - index_put: index_backward's zeros.index_put_ (out of place for subclass-like tensors);
#: - scatter_add: gather_backward's (cross entropy's gather) zeros.scatter_add_;
#: - index_add: index_select_backward's zeros.index_add_;
#: Not folded: InputBuffer::accumulate's add (in place only when the engine holds the buffer's
#: last reference, which a dispatch mode cannot observe: folding every add whose input dies
#: next made the 2.6 comparison worse, docs/tracing.md).
_FOLDABLE = frozenset({
    _aten.scatter.src, _aten.scatter.value, _aten.index_put.default,
    _aten.scatter_add.default, _aten.index_add.default,
})


@dataclass(frozen=True)
class Workspace:
    """One request a CUDA kernel makes besides its outputs: freed when the op returns unless
    ``persistent`` (kept for the process: the cuBLAS workspace)."""

    nbytes: int
    what: str
    persistent: bool = False


class CudaKernelRules:
    """The rules for one recording (it remembers which threads have a cuBLAS workspace)."""

    def __init__(self, target: Optional[CudaTarget] = None) -> None:
        self.target = target or CudaTarget.for_gpu()
        self._blas_threads: set[str] = set()
        self._lock = threading.Lock()

    def steady_state_workspaces(self) -> list[Workspace]:
        """The persistent workspaces an earlier iteration left that this recording has not
        made yet: the cuBLAS workspace of each GEMM thread (main and autograd)."""
        with self._lock:
            missing = [t for t in _BLAS_THREADS if t not in self._blas_threads]
            self._blas_threads.update(missing)
        return [Workspace(self.target.blas_workspace_bytes, _BLAS_WORKSPACE, True)
                for _ in missing]

    # ------------------------------------------------------------------ workspaces
    def workspaces(self, func, args, kwargs, out, in_backward: bool) -> list[Workspace]:
        """The extra requests of ``func(*args, **kwargs)`` -> ``out`` on the target GPU, in
        the order the CUDA kernel makes them (after its outputs)."""
        if func in _REDUCTIONS:
            return self._reduction(func, args, out)
        if func is _aten.mse_loss.default:
            return _elementwise_loss(args, kwargs)
        if func in _INDEX_PUT_OPS:
            return _index_put_with_sort(args, kwargs)
        if func in (_TILE_FORWARD, _TILE_BACKWARD):
            return self._attention_tile(func, args, kwargs)
        if func not in _BLAS_OPS:
            return []
        found = self._operand_copies(func, args)
        # The autograd engine runs a CUDA device's backward on its own thread, whose handle
        # pool window reserves another cuBLAS handle: a second workspace at its first GEMM.
        thread = _BLAS_THREADS[1] if in_backward else _BLAS_THREADS[0]
        with self._lock:
            first = thread not in self._blas_threads
            self._blas_threads.add(thread)
        if self.target.lt_workspace_per_call and _uses_lt(func, args, kwargs, out):
            # gemm_and_bias allocates it before it fetches the handle (first, in a torch 2.3
            # snapshot, a 1 MiB request, then the cuBLAS workspace).
            found.append(Workspace(LT_WORKSPACE_BYTES, "cuBLASLt workspace (gemm_and_bias)"))
        if first:
            found.append(Workspace(self.target.blas_workspace_bytes, _BLAS_WORKSPACE, True))
        return found

    def _attention_tile(self, func, args, kwargs) -> list[Workspace]:
        """A memo_attention tile on the CUDA kernel the target GPU runs it with
        (memo_ext.attention.kernels.declared_tile_kernel: cuDNN's or FlashAttention-2's, by
        the trainer's dispatch rule): what it allocates besides the op's outputs
        (forward_workspaces / backward_workspaces; nothing for tiles the explicit kernel runs,
        or when workspaces are not declared)."""
        named = {**dict(zip((a.name for a in func._schema.arguments), args)), **kwargs}
        q, k = named["q"], named["k"]
        kernel = attention_kernels.declared_tile_kernel(q, k, named["dropout_p"])
        if kernel is None or kernel == "explicit":
            return []
        if func is _TILE_FORWARD:
            requests = attention_kernels.forward_workspaces(
                q, k, self.target.sm_count, self.target.flash_attn, kernel)
        else:
            requests = attention_kernels.backward_workspaces(
                named["grad_out"], q, k, named["out"], named["lse"], self.target.flash_attn,
                kernel)
        return [Workspace(request.nbytes, request.what) for request in requests]

    def _operand_copies(self, func, args) -> list[Workspace]:
        """Operands cuBLAS cannot read in place are cloned contiguous first (at::native
        prepare_matrix_for_cublas / prepare_batch_matrix_for_cublas, Blas.cpp)."""
        copies = []
        if func in _MATRIX_OPS:
            for index in _MATRIX_OPS[func]:
                if _matrix_needs_copy(args[index]):
                    copies.append(Workspace(_contiguous_bytes(args[index]),
                                            "operand copy (prepare_matrix_for_cublas)"))
        elif func in _BATCHED_OPS:
            first, second = (args[i] for i in _BATCHED_OPS[func])
            m, n, k = first.shape[1], second.shape[2], first.shape[2]
            # The result is fresh and contiguous: not transposed (Blas.cpp
            # baddbmm_out_cuda_impl), so operands are checked with transpose_result false.
            for tensor, rows, cols in ((first, m, k), (second, k, n)):
                if _batch_matrix_needs_copy(tensor, rows, cols):
                    copies.append(Workspace(_contiguous_bytes(tensor),
                                            "operand copy (prepare_batch_matrix_for_cublas)"))
        return copies

    def _reduction(self, func, args, out) -> list[Workspace]:
        """gpu_reduce_kernel's scratch when it splits an output's inputs across thread blocks
        (memo_ext.trace.cuda_reduce, a port of Reduce.cuh's launch configuration)."""
        tensor = args[0]
        if not tensor.is_floating_point() or tensor.numel() == 0:
            return []  # integer sums read an int64 copy first (make_reduction): not modelled
        dim_index = _REDUCTIONS[func]
        dims = args[dim_index] if dim_index is not None and len(args) > dim_index else None
        if isinstance(dims, int):
            dims = [dims]
        output = out if isinstance(out, torch.Tensor) else out[0]
        extra = {}
        if func in _INDEXED_REDUCTIONS:
            acc = 16  # std::pair<scalar_t, int64_t>, 8-byte aligned
            extra = dict(num_outputs=2, second_output_itemsize=8,
                         can_accumulate_in_output=False)
        elif func in (_aten.amax.default, _aten.amin.default):
            acc = tensor.element_size()  # compared in the input's own type
        else:
            acc = 8 if tensor.dtype == torch.float64 else 4  # float accumulation (acc_type)
        # Reduce.cuh was compared from 2.4 on; older releases differ only in vectorisation
        version = max(self.target.torch_version, (2, 4))
        sizes = reduction_workspace(
            tuple(tensor.shape), tuple(tensor.stride()), dims or None,
            input_itemsize=tensor.element_size(), acc_itemsize=acc,
            output_itemsize=output.element_size(), sm_count=self.target.sm_count,
            max_threads_per_sm=self.target.max_threads_per_sm, torch_version=version,
            input_storage_offset=tensor.storage_offset(), **extra)
        return [Workspace(n, REDUCTION_SCRATCH) for n in sizes]

    # ------------------------------------------------------------------ sizes
    @staticmethod
    def cuda_sizes(func, args, out, op_of) -> list[tuple[torch.Tensor, int]]:
        """Outputs the CUDA kernel makes at another size than the CPU one: (tensor, bytes).
        ``op_of(tensor)`` names the op that allocated a tensor.

        - native_layer_norm keeps mean and rstd in the accumulate type, fp32, for 16-bit
          inputs (layer_norm_kernel.cu); the CPU kernel and its fake rule use the input type.
        - dropout: on CUDA ``at::dropout`` runs the fused native_dropout, whose mask is bool (1
          byte per element); elsewhere it draws ``empty_like(input).bernoulli_(1 - p)`` and keeps
          that noise in the input's type (Dropout.cpp, is_fused_kernel_acceptable). The noise is
          recorded as the mask.
        """
        if func is _aten.native_layer_norm.default and args[0].dtype in _HALF_TYPES:
            return [(stat, stat.numel() * 4) for stat in out[1:3]]
        if (func is _aten.bernoulli_.float and args[0].is_floating_point()
                and op_of(args[0]) == "aten.empty_like.default"):
            return [(args[0], args[0].numel())]
        return []

    # ------------------------------------------------------------------ folds
    @staticmethod
    def folds(func) -> bool:
        """Whether ``func``'s output, run by an autograd node, is folded into the zeros it
        updates (its first argument, when the recorder saw a zeros factory make it and the
        layouts agree): an autograd branch CUDA runs in place; see _FOLDABLE."""
        return func in _FOLDABLE

    @staticmethod
    def same_dense_layout(source: torch.Tensor, result: torch.Tensor) -> bool:
        """The in-place branch's layout condition: the tensor updated in place is dense and
        non-overlapping and has the result's shape and strides."""
        return (source.shape == result.shape and source.stride() == result.stride()
                and source.storage_offset() == 0
                and is_non_overlapping_and_dense_or_false(source))


_TILE_FORWARD = torch.ops.memo_attention.tile_forward.default
_TILE_BACKWARD = torch.ops.memo_attention.tile_backward.default

_INDEX_PUT_OPS = (_aten.index_put.default, _aten.index_put_.default,
                  _aten._index_put_impl_.default)


def _index_put_with_sort(args, kwargs) -> list[Workspace]:
    """index_put with ``accumulate`` (the embedding's backward through IndexBackward0) runs
    index_put_with_sort_kernel (aten/src/ATen/native/cuda/Indexing.cu): makeLinearIndex
    computes the linear index (a remainder and a product, int64 per index), then the sort takes
    sorted and original-position index tensors and an arange, and cub a 1-byte request; all
    freed on return. Two real snapshots (torch 2.6 and 2.11) show this sequence."""
    accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
    indices = [i for i in args[1] if i is not None] if len(args) > 1 else []
    if not accumulate or len(indices) != 1 or indices[0].dtype == torch.bool:
        return []
    count = indices[0].numel()
    value = args[2]
    found = [Workspace(count * 8, "linear index (makeLinearIndex)"),
             Workspace(count * 8, "linear index (makeLinearIndex)")]
    if not value.is_contiguous():
        found.append(Workspace(_contiguous_bytes(value), "values made contiguous"))
    found += [Workspace(count * 8, "sorted indices"), Workspace(count * 8, "original positions"),
              Workspace(count * 8, "arange"), Workspace(1, "cub sort")]
    return found


def _elementwise_loss(args, kwargs) -> list[Workspace]:
    """mse_loss with a reduction computes the elementwise loss into a tensor of the broadcast
    input shape (aten/src/ATen/native/Loss.cpp: TensorIterator output, then
    apply_loss_reduction) and frees it once reduced; the fake kernel allocates only the
    reduced result (a torch 2.3 snapshot shows both requests)."""
    reduction = kwargs.get("reduction", args[2] if len(args) > 2 else 1)
    if reduction == 0:  # Reduction::None returns the elementwise loss itself
        return []
    shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
    return [Workspace(shape.numel() * args[0].element_size(), "elementwise loss (mse_loss)")]


def _contiguous_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _matrix_needs_copy(tensor: torch.Tensor) -> bool:
    """prepare_matrix_for_cublas: a dense tensor (either major order) is read in place; else
    one whose strides are a (possibly transposed) column-major layout with a leading dimension
    of at least its rows; anything else is cloned."""
    if tensor.dim() != 2 or is_non_overlapping_and_dense_or_false(tensor):
        return False
    (rows, cols), (s0, s1) = tensor.shape, tensor.stride()
    if s0 == 1 and s1 >= max(1, rows):
        return False
    if s1 == 1 and s0 >= max(1, cols):
        return False
    return True


def _batch_matrix_needs_copy(tensor: torch.Tensor, rows: int, cols: int) -> bool:
    """prepare_batch_matrix_for_cublas with a non-transposed result: the matrix is read in
    place when one of its two inner strides is 1 and the other a leading dimension of at least
    ``rows`` (column-major view) or ``cols`` (row-major view), or when it is contiguous with
    non-zero inner strides; otherwise cloned contiguous (expanded, stride-0 gradients are)."""
    s1, s2 = tensor.stride(1), tensor.stride(2)
    if s1 == 1 and s2 >= max(1, rows):
        return False
    if s2 == 1 and s1 >= max(1, cols):
        return False
    return not (tensor.is_contiguous() and s1 != 0 and s2 != 0)


def _uses_lt(func, args, kwargs, out) -> bool:
    """addmm_out_cuda_impl's cuBLASLt path (gemm_and_bias): a 1-D contiguous bias, beta 1, a
    2-D contiguous result, both of mat2's sizes above 1, every size below 65535 * 32, and a
    float type."""
    if func not in (_aten.addmm.default, _aten._addmm_activation.default):
        return False
    bias, mat1, mat2 = args[0], args[1], args[2]
    beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
    limit = 65535 * 32
    return (bias.dim() == 1 and bias.is_contiguous() and beta == 1
            and isinstance(out, torch.Tensor) and out.is_contiguous()
            and bias.shape[0] == mat2.shape[1]
            and out.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
            and mat2.shape[0] > 1 and mat2.shape[1] > 1
            and all(size < limit for size in (*mat1.shape, *mat2.shape)))


#: Ops a CUDA build dispatches to a fused kernel and the CPU build decomposes (their
#: CompositeImplicitAutograd fallback): aten/src/ATen/native/layer_norm.cpp, rms_norm_symint,
#: calls at::_fused_rms_norm off MPS (after its composite fallbacks for channels-last, complex
#: and a weight of another dtype), whose CUDA kernel returns the output and fp32 rstd and whose
#: backward is _fused_rms_norm_backward. On CPU the fallback upcasts the input and keeps fp32
#: intermediates for backward.
_FUSED_ON_CUDA = (_aten._fused_rms_norm.default, _aten._fused_rms_norm_backward.default)
_paths_lock = threading.Lock()
_paths_users = 0
_paths_library = None


@contextlib.contextmanager
def cuda_kernel_paths():
    """While active, CPU autograd runs :data:`_FUSED_ON_CUDA` as single ops, as a CUDA build
    does: each gets a CPU kernel computing torch._decomp's reference decomposition, so values
    are unchanged and a dispatch mode sees the fused op and its outputs. Removed on exit (the
    CPU trainer keeps PyTorch's composite); nested uses share one registration."""
    global _paths_users, _paths_library
    from torch._decomp import decomposition_table

    with _paths_lock:
        if _paths_users == 0:
            _paths_library = torch.library.Library("aten", "IMPL")
            for op in _FUSED_ON_CUDA:
                _paths_library.impl(op._schema.name.split("::")[1], decomposition_table[op],
                                    "CPU")
        _paths_users += 1
    try:
        yield
    finally:
        with _paths_lock:
            _paths_users -= 1
            if _paths_users == 0:
                _paths_library._destroy()
                _paths_library = None
