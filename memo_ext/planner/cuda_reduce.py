"""The global-memory workspace of PyTorch's CUDA reductions, computed without a GPU.

``gpu_reduce_kernel`` (aten/src/ATen/native/cuda/Reduce.cuh) serves sum, mean, prod, amax/amin,
max/min with indices, argmax/argmin, norms, var/std and their ``_mean`` variants. When its launch
configuration splits each output's inputs across several thread blocks
(``ReduceConfig::ctas_per_output > 1``) it takes two blocks from the CUDA caching allocator: a
staging buffer (``ReduceConfig::global_memory_size``) and a semaphore array
(``ReduceConfig::semaphore_size``), both freed as soon as the kernel is enqueued. An iterator too
large for 32-bit indexing is split into sub-iterators, one launch each, and a reduction that
cannot accumulate in its output first takes an accumulation buffer (``AccumulationBuffer``) that
lives across those launches. A fake-tensor recorder sees none of this; :func:`plan_reduction`
reproduces it.

Hand-written because no library exposes it: the decision is made in C++ from the
TensorIterator's coalesced and reordered shape and strides, the device's SM count and the
kernel's template parameters, and nothing in PyTorch's Python API reports it. What follows is a
port of, in aten/src/ATen:

- TensorIterator.cpp: ``compute_strides``, ``reorder_dimensions``, ``coalesce_dimensions``,
  ``num_output_elements``, ``num_reduce_dims``, ``can_use_32bit_indexing``,
  ``get_dim_to_split``, ``split`` and ``SplitUntil32Bit`` (read from one stored copy of the
  file; long-stable code, not compared release by release -- wheels ship no .cpp);
- native/ReduceOpsUtils.h: ``review_reduce_result`` (the output seen with stride 0 on reduced
  dims; ``resize_reduction`` allocates the output contiguous);
- native/cuda/Reduce.cuh: ``setReduceConfig``, ``get_output_vec_size``,
  ``ReduceConfig::set_block_dimension`` / ``global_memory_size`` / ``semaphore_size``,
  ``AccumulationBuffer`` and ``gpu_reduce_kernel``.

Versions. The Reduce.cuh headers of the torch 2.4.0, 2.5.0, 2.6.0, 2.7.0, 2.8.0, 2.9.0, 2.10.0,
2.11.0, 2.12.0, 2.13.0 and 2.14.1 wheels were compared. On CUDA (ROCm branches aside) only the
"vectorize along input" condition changed (:func:`_input_vector_width`):

- 2.4 - 2.6: when ``dim0 > 128`` and ``vt0 >= 4``, dividing by the constant
  ``ReduceConfig::input_vec_size`` (4);
- 2.7 - 2.9: ``input_vec_size`` became a template parameter (default ``vt0``), still guarded by
  ``dim0 > 128 && vt0 >= input_vec_size``;
- 2.10 and later: ``dim0 >= 128`` with no ``vt0`` guard.

That change never alters the workspace: a launch that reduces across blocks has so many inputs
per output that its block width is at its cap under any vector width, and block.x is not in
the size of a block.x-reduced buffer (see :func:`_input_vector_width`). ``torch_version`` only
shows in :class:`ReduceLaunch`'s ``block_x`` / ``vectorize_input``. (2.14 writes
``ctas_per_output`` as ``std::clamp(c1, c3, c2)``, equal to the older ``max(min(c1, c2), c3)``
since ``c3 <= c2``.) Releases before 2.4 are refused: not compared.

The per-op template arguments live in the .cu files, not in the headers: var/std use ``vt0=2``
(ReduceMomentKernel.cu); in current main, sum and mean of 16-bit inputs pass ``vt0=4,
input_vec_size=8`` (ReduceSumProdKernel.cu, ReduceMomentKernel.cu) -- the release that
introduced this was not pinned down, so the caller passes ``input_vec_size``.

Checked against a real torch 2.6 snapshot (tests/unit/memo_ext/planner/test_cuda_reduce.py): with that run's
layouts and GPU (128 SMs of 1536 threads), the 10485760 + 32 B of each RMSNorm 1/rms gradient
sum, the nothing of each gain gradient sum and the 1536 + 4 B of the logits' sum come out exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

#: ``std::numeric_limits<int32_t>::max()``, the bound of TensorIterator's 32-bit indexing.
_INT32_MAX = (1 << 31) - 1
#: ``sizeof(int)``: one semaphore per block column (Reduce.cuh, semaphore_size).
_SEMAPHORE_BYTES = 4
#: setReduceConfig's per-thread work bounds on CUDA (ROCm uses 128 as the minimum).
_MIN_VALUES_PER_THREAD = 16
_MAX_VALUES_PER_THREAD = 256
#: ReduceConfig::input_vec_size before it became a template parameter (2.4 - 2.6).
_LEGACY_INPUT_VEC_SIZE = 4
_OLDEST_COMPARED = (2, 4)


@dataclass(frozen=True)
class ReduceLaunch:
    """One ``reduce_kernel`` launch: the ReduceConfig setReduceConfig chose, and its workspace.

    ``global_memory_bytes`` and ``semaphore_bytes`` are 0 when the launch does not reduce across
    blocks (``ctas_per_output == 1``); otherwise they are the sizes passed to the caching
    allocator, staging buffer first."""

    num_outputs: int
    inputs_per_output: int
    block_x: int
    block_y: int
    grid_x: int
    ctas_per_output: int
    output_vec_size: int
    vectorize_input: bool
    values_per_thread: int
    global_memory_bytes: int
    semaphore_bytes: int

    @property
    def allocations(self) -> list[int]:
        if not self.global_memory_bytes:
            return []
        return [self.global_memory_bytes, self.semaphore_bytes]


@dataclass(frozen=True)
class ReducePlan:
    """Every allocation one ``gpu_reduce_kernel`` call makes besides its output.

    Lifetimes (Reduce.cuh, gpu_reduce_kernel): the accumulation buffer, when there is one, is
    taken first and freed after the last launch; each launch takes its staging buffer and then
    its semaphores, and frees them when it returns (semaphores first: C++ destroys the two
    ``at::DataPtr`` locals in reverse order), before the next launch allocates."""

    accumulation_buffer_bytes: int
    launches: tuple[ReduceLaunch, ...]

    @property
    def allocations(self) -> list[int]:
        sizes = [self.accumulation_buffer_bytes] if self.accumulation_buffer_bytes else []
        for launch in self.launches:
            sizes.extend(launch.allocations)
        return sizes


@dataclass
class _Iterator:
    """The parts of a reduction TensorIterator that setReduceConfig reads: the shape and the
    byte strides of each operand (outputs first, the input last), and the input's byte offset
    from its allocation's start (only its alignment matters)."""

    shape: list[int]
    strides: list[list[int]]
    input_offset: int

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def output_strides(self) -> list[int]:
        return self.strides[0]

    @property
    def input_strides(self) -> list[int]:
        return self.strides[-1]

    def numel(self) -> int:
        return _prod(self.shape)

    def num_reduce_dims(self) -> int:
        # TensorIteratorBase::num_reduce_dims: dims where output 0 has stride 0.
        return sum(1 for s in self.output_strides if s == 0)

    def num_output_elements(self) -> int:
        # TensorIteratorBase::num_output_elements.
        return _prod(size for size, s in zip(self.shape, self.output_strides)
                     if s != 0 or size == 0)


def reduction_workspace(*args, **kwargs) -> list[int]:
    """Byte sizes of the blocks ``gpu_reduce_kernel`` takes from the caching allocator besides
    its output, in allocation order ([] when it takes none): for one launch, the staging buffer
    then the semaphores. Takes :func:`plan_reduction`'s arguments; see :class:`ReducePlan` for
    when each block is freed."""
    return plan_reduction(*args, **kwargs).allocations


def plan_reduction(input_shape: Sequence[int], input_strides: Sequence[int],
                   reduced_dims: Optional[Sequence[int]], input_itemsize: int,
                   acc_itemsize: int, output_itemsize: int, num_outputs: int = 1, *,
                   sm_count: int, max_threads_per_sm: int = 2048, warp_size: int = 32,
                   max_threads_per_block: int = 512, vt0: int = 4,
                   input_vec_size: Optional[int] = None,
                   torch_version: Optional[tuple[int, int]] = None, keepdim: bool = False,
                   input_storage_offset: int = 0,
                   second_output_itemsize: Optional[int] = None,
                   can_accumulate_in_output: Optional[bool] = None) -> ReducePlan:
    """The launches of one CUDA reduction and the workspace each takes.

    - ``input_shape`` / ``input_strides`` (elements) / ``input_itemsize``: the tensor the kernel
      reads (``scalar_t``; for a mixed-precision sum of bf16 into fp32 that is the bf16 input,
      for an integer sum the int64 copy ``make_reduction`` makes first);
      ``input_storage_offset`` (elements) sets its alignment, which output vectorization checks.
    - ``reduced_dims``: None or empty reduces every dim (``make_dim_mask``); negative dims wrap.
    - ``acc_itemsize``: ``sizeof(arg_t)``, the accumulator (4 for fp16/bf16/fp32 sum and mean, 8
      for fp64 and int64 sums; the input's own size for amax/amin; 16 for the (value, index)
      pair of max.dim/argmax on 4-byte accumulators; 16 for Welford's fp32 state).
    - ``output_itemsize``: the output's element size; ``num_outputs`` 2 for reductions with two
      outputs (max.dim/min.dim: values and int64 indices, ``second_output_itemsize`` 8;
      var_mean/std_mean: both the output dtype). The second output only enters the 32-bit
      indexing check and the choice of the dim to split.
    - ``sm_count``, ``max_threads_per_sm`` (cudaDeviceProp multiProcessorCount and
      maxThreadsPerMultiProcessor: 132 and 2048 on H100 SXM, 108 and 2048 on A100),
      ``warp_size`` (``at::cuda::warp_size()``), ``max_threads_per_block``
      (``mnt_wrapper<scalar_t>::MAX_NUM_THREADS``: 512, 256 for complex128).
    - ``vt0`` / ``input_vec_size``: the kernel's template arguments (module docstring);
      ``input_vec_size`` None means the release's default.
    - ``torch_version``: (major, minor) of the run; None takes the installed torch's.
    - ``keepdim``: the output's layout on reduced dims of size 1 (it only reorders ties).
    - ``can_accumulate_in_output``: Reduce.cuh's constant; None derives it for a sum-like op
      (False when input and output are both 2-byte floats). Pass False for ops whose ``arg_t``
      does not convert to the output (Welford, the (value, index) pairs) and for complex32.
    """
    version = torch_version if torch_version is not None else _installed_torch()
    if tuple(version[:2]) < _OLDEST_COMPARED:
        raise ValueError(f"torch {version[0]}.{version[1]}: Reduce.cuh was compared from "
                         f"{_OLDEST_COMPARED[0]}.{_OLDEST_COMPARED[1]} on; not ported")
    if len(input_shape) != len(input_strides):
        raise ValueError(f"shape {tuple(input_shape)} and strides {tuple(input_strides)} "
                         "differ in length")
    if num_outputs not in (1, 2):
        raise ValueError(f"gpu_reduce_kernel has one or two outputs, not {num_outputs}")
    if _prod(input_shape) == 0:
        return ReducePlan(0, ())  # sum_out & co. fill the output; no kernel runs
    vec = input_vec_size
    if vec is None:
        vec = _LEGACY_INPUT_VEC_SIZE if tuple(version[:2]) < (2, 7) else vt0
    if can_accumulate_in_output is None:
        can_accumulate_in_output = not (input_itemsize == 2 and output_itemsize == 2)
    out_sizes = [output_itemsize] * num_outputs
    if num_outputs == 2 and second_output_itemsize is not None:
        out_sizes[1] = second_output_itemsize

    it = _build_iterator(input_shape, input_strides, reduced_dims, input_itemsize, out_sizes,
                         keepdim, input_storage_offset * input_itemsize)

    # gpu_reduce_kernel: an AccumulationBuffer is made once, at the top level, when the
    # iterator will be split and the output cannot hold partial results.
    acc_bytes = 0
    if not can_accumulate_in_output and not _can_use_32bit_indexing(it):
        output_elements = output_itemsize
        for size, stride in zip(it.shape, it.output_strides):
            output_elements = max(output_elements, size * stride)
        output_elements //= output_itemsize
        if output_itemsize < acc_itemsize:  # else the output itself is reused
            acc_bytes = output_elements * acc_itemsize

    launches = tuple(
        _set_reduce_config(sub, input_itemsize, acc_itemsize, vt0, vec, version, sm_count,
                           max_threads_per_sm, warp_size, max_threads_per_block)
        for sub in _split_until_32bit(it))
    return ReducePlan(acc_bytes, launches)


# ---------------------------------------------------------------------- TensorIterator


def _build_iterator(shape: Sequence[int], strides: Sequence[int],
                    reduced_dims: Optional[Sequence[int]], input_itemsize: int,
                    output_itemsizes: Sequence[int], keepdim: bool,
                    input_offset: int) -> _Iterator:
    """TensorIterator::reduce_op(review_reduce_result(result), self) after build()."""
    ndim = len(shape)
    if reduced_dims is None or len(reduced_dims) == 0:
        mask = [True] * ndim  # make_dim_mask: no dims means all dims
    else:
        mask = [False] * ndim
        for d in reduced_dims:
            if not -max(ndim, 1) <= d < max(ndim, 1):
                raise ValueError(f"dim {d} out of range for {ndim} dims")
            if ndim:
                mask[d % ndim] = True
    # The output as allocated: contiguous over its own shape (resize_reduction passes no
    # strides); review_reduce_result re-inserts removed dims with size 1 and stride 0.
    out_shape = [1 if m else size for size, m in zip(shape, mask)]
    out_elem_strides = [0] * ndim
    running = 1
    for d in reversed(range(ndim)):
        if mask[d] and not keepdim:
            continue
        out_elem_strides[d] = running
        running *= max(out_shape[d], 1)
    operand_strides = []
    for itemsize in output_itemsizes:
        # compute_strides: a size-1 output dim under a larger loop dim is broadcast (stride 0).
        operand_strides.append([
            0 if (out_shape[d] == 1 and shape[d] != 1) else out_elem_strides[d] * itemsize
            for d in range(ndim)])
    operand_strides.append([s * input_itemsize for s in strides])
    it = _Iterator(list(shape), operand_strides, input_offset)
    _reorder_dimensions(it, num_outputs=len(output_itemsizes))
    _coalesce_dimensions(it)
    return it


def _reorder_dimensions(it: _Iterator, num_outputs: int) -> None:
    """TensorIteratorBase::reorder_dimensions: fastest-moving dims first, reduced dims (output
    stride 0) ahead of all others; an insertion sort that skips ambiguous comparisons."""
    ndim = it.ndim
    if ndim <= 1:
        return
    perm = list(reversed(range(ndim)))

    def should_swap(dim0: int, dim1: int) -> int:
        for arg, strides in enumerate(it.strides):
            stride0, stride1 = strides[dim0], strides[dim1]
            if arg < num_outputs and (stride0 == 0) != (stride1 == 0):
                return 1 if stride1 == 0 else -1
            if stride0 == 0 or stride1 == 0:
                continue
            if stride0 < stride1:
                return -1
            if stride0 > stride1:
                return 1
            if it.shape[dim0] > it.shape[dim1]:  # equal strides: smaller size goes first
                return 1
        return 0

    for i in range(1, ndim):
        dim1 = i
        for dim0 in range(i - 1, -1, -1):
            comparison = should_swap(perm[dim0], perm[dim1])
            if comparison > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif comparison < 0:
                break
    it.shape = [it.shape[p] for p in perm]
    it.strides = [[strides[p] for p in perm] for strides in it.strides]


def _coalesce_dimensions(it: _Iterator) -> None:
    """TensorIteratorBase::coalesce_dimensions: merge neighbours that are size 1 or that every
    operand walks contiguously (shape[n] * stride[n] == stride[n + 1])."""
    if it.ndim <= 1:
        return
    shape, strides = it.shape, it.strides

    def can_coalesce(dim0: int, dim1: int) -> bool:
        if shape[dim0] == 1 or shape[dim1] == 1:
            return True
        return all(shape[dim0] * s[dim0] == s[dim1] for s in strides)

    def replace_stride(dim0: int, dim1: int) -> None:
        for s in strides:
            s[dim0] = s[dim1]

    prev = 0
    for dim in range(1, it.ndim):
        if can_coalesce(prev, dim):
            if shape[prev] == 1:
                replace_stride(prev, dim)
            shape[prev] *= shape[dim]
        else:
            prev += 1
            if prev != dim:
                replace_stride(prev, dim)
                shape[prev] = shape[dim]
    del shape[prev + 1:]
    for s in strides:
        del s[prev + 1:]


def _can_use_32bit_indexing(it: _Iterator) -> bool:
    """TensorIteratorBase::can_use_32bit_indexing, over every operand's byte extent."""
    if it.numel() > _INT32_MAX:
        return False
    for strides in it.strides:
        offset = 1 + sum((size - 1) * s for size, s in zip(it.shape, strides))
        if offset > _INT32_MAX:
            return False
    return True


def _split_until_32bit(it: _Iterator) -> Iterator[_Iterator]:
    """SplitUntil32Bit: halve the dim with the largest byte extent (get_dim_to_split, ties to
    the higher dim) until each piece indexes in 32 bits; the first half (``split``'s copy) is
    run first. Reductions are not re-coalesced after ``narrow``."""
    if _can_use_32bit_indexing(it):
        yield it
        return
    dim, best = -1, -1
    for d in range(it.ndim - 1, -1, -1):
        if it.shape[d] == 0:
            continue
        for strides in it.strides:
            extent = (it.shape[d] - 1) * abs(strides[d])
            if extent > best:
                dim, best = d, extent
    first_size = it.shape[dim] // 2
    first = _Iterator(list(it.shape), [list(s) for s in it.strides], it.input_offset)
    first.shape[dim] = first_size
    second = _Iterator(list(it.shape), [list(s) for s in it.strides],
                       it.input_offset + it.input_strides[dim] * first_size)
    second.shape[dim] = it.shape[dim] - first_size
    yield from _split_until_32bit(first)
    yield from _split_until_32bit(second)


# ---------------------------------------------------------------------- Reduce.cuh


def _set_reduce_config(it: _Iterator, input_itemsize: int, acc_itemsize: int, vt0: int,
                       input_vec_size: int, version: tuple[int, int], sm_count: int,
                       max_threads_per_sm: int, warp_size: int,
                       max_threads_per_block: int) -> ReduceLaunch:
    """Reduce.cuh setReduceConfig (CUDA branch), then the workspace sizes of the ReduceConfig
    it returns."""
    ndim = it.ndim
    num_outputs = it.num_output_elements()
    inputs_per_output = it.numel() // num_outputs
    n_reduce = it.num_reduce_dims()
    in_strides = it.input_strides

    # Map block.x to the fastest-moving dim: the reduced one (block_x_reduce, dim1 up to the
    # outputs) or the fastest kept one (no block_x_reduce, dim1 up to inputs per output).
    if ndim > 0:
        on_fastest = n_reduce == ndim or in_strides[0] < in_strides[n_reduce]
        if on_fastest:
            dim0, dim1, fastest_stride = inputs_per_output, num_outputs, in_strides[0]
        else:
            dim0, dim1, fastest_stride = num_outputs, inputs_per_output, in_strides[n_reduce]
    else:
        on_fastest, fastest_stride, dim0, dim1 = True, input_itemsize, 1, 1

    # "Vectorize along input" (one reduced dim, contiguous) or "along output".
    vectorize_input, output_vec_size = False, 1
    if fastest_stride == input_itemsize:
        width = _input_vector_width(dim0, vt0, input_vec_size, version)
        if on_fastest and n_reduce == 1 and width:
            vectorize_input = True
            dim0 //= width
        elif not on_fastest:
            output_vec_size = _output_vec_size(it, n_reduce, input_itemsize)
            dim0 //= output_vec_size

    # ReduceConfig::set_block_dimension<scalar_t>.
    max_threads = max_threads_per_block // output_vec_size
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    block_x = min(dim0_pow2, warp_size)
    block_y = min(dim1_pow2, max_threads // block_x)
    block_x = min(dim0_pow2, max_threads // block_y)
    num_threads = block_x * block_y

    # split_input / split_output: lanes first, then warps, then blocks (ctas).
    step_input = step_output = 1
    block_x_reduce = ndim == 0 or on_fastest
    if block_x_reduce:
        step_input *= block_x
    else:
        step_output *= block_x
    split_across_warps = (_div_up(inputs_per_output, step_input)
                          >= min(block_y * 16, _MAX_VALUES_PER_THREAD))
    if split_across_warps:
        step_input *= block_y
    else:
        step_output *= block_y

    blocks_per_sm = max_threads_per_sm // num_threads
    target_grid_size = sm_count * blocks_per_sm
    grid_x = _div_up(num_outputs // output_vec_size, step_output)
    values_per_thread = _div_up(inputs_per_output, step_input)
    ctas_per_output = 1
    if (split_across_warps and values_per_thread >= _MAX_VALUES_PER_THREAD
            and grid_x <= target_grid_size):
        # Enough blocks to fill the SMs, as few as keep >= 16 values per thread, and never
        # more than 256 values per thread.
        ctas_per_output = max(min(_div_up(target_grid_size, grid_x),
                                  _div_up(values_per_thread, _MIN_VALUES_PER_THREAD)),
                              _div_up(values_per_thread, _MAX_VALUES_PER_THREAD))
        if ctas_per_output > 1:
            step_input *= ctas_per_output
            values_per_thread = _div_up(inputs_per_output, step_input)

    global_bytes = semaphore_bytes = 0
    if ctas_per_output > 1:  # should_global_reduce
        global_bytes = acc_itemsize * num_outputs * ctas_per_output
        if not block_x_reduce:  # every lane of a block column stages its own outputs
            global_bytes *= block_x * output_vec_size
        semaphore_bytes = _SEMAPHORE_BYTES * grid_x
    return ReduceLaunch(num_outputs=num_outputs, inputs_per_output=inputs_per_output,
                        block_x=block_x, block_y=block_y, grid_x=grid_x,
                        ctas_per_output=ctas_per_output, output_vec_size=output_vec_size,
                        vectorize_input=vectorize_input, values_per_thread=values_per_thread,
                        global_memory_bytes=global_bytes, semaphore_bytes=semaphore_bytes)


def _input_vector_width(dim0: int, vt0: int, input_vec_size: int,
                        version: tuple[int, int]) -> int:
    """The divisor of "vectorize along input" for this release, or 0 when it is off (the
    module docstring lists the three forms of the condition).

    Why the workspace does not depend on it: a global reduction needs, per output, inputs >=
    256 * block.x * block.y. Were block.x below its cap (max threads / block.y) it would be
    last_pow2(dim0) > dim0 / 2 = inputs / (2 * width) >= inputs / 16, a contradiction; and
    block.y follows from min(last_pow2(dim0), warp) = warp, since dim0 >= 256 / 8."""
    if tuple(version[:2]) < (2, 7):
        return _LEGACY_INPUT_VEC_SIZE if dim0 > 128 and vt0 >= _LEGACY_INPUT_VEC_SIZE else 0
    if tuple(version[:2]) < (2, 10):
        return input_vec_size if dim0 > 128 and vt0 >= input_vec_size else 0
    return input_vec_size if dim0 >= 128 else 0


def _output_vec_size(it: _Iterator, n_reduce: int, input_itemsize: int) -> int:
    """Reduce.cuh get_output_vec_size: 4, halved until it divides the input's address (in
    elements), the fastest kept dim's size and every other input stride (in elements)."""
    vec = 4

    def fit(n: int) -> None:
        nonlocal vec
        while n % vec:
            vec //= 2

    fit(it.input_offset // input_itemsize)  # allocations start 512-byte aligned
    fit(it.shape[n_reduce])
    for d, stride in enumerate(it.input_strides):
        if d != n_reduce:
            fit(abs(stride) // input_itemsize)  # |.|: C++ truncates toward 0
    return vec


def _last_pow2(n: int) -> int:
    """Reduce.cuh last_pow2: the largest power of two <= n, at least 1."""
    return 1 << (n.bit_length() - 1) if n >= 1 else 1


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _installed_torch() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)
