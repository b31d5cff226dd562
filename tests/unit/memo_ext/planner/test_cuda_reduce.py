"""memo_ext.planner.cuda_reduce: the workspace gpu_reduce_kernel takes, against sizes derived
by hand from Reduce.cuh's setReduceConfig and against a real CUDA memory snapshot.

The snapshot (notHanmin/assignment2-systems @ 33be88e, memory_snapshot.pickle; torch 2.6, fp32
TransformerLM d_model 1280, batch 4 x 256 tokens, vocab 10000) shows, per step:
- 73 x sum over the hidden dim of a [4, 256, 1280] gradient (RMSNorm's 1/rms, output 4096 B)
  taking 10485760 + 32 B; its input was allocated strided (empty_strided, hidden dim
  outermost: strides (256, 1, 1024));
- 73 x sum over (0, 1) of the same layout (RMSNorm's gain, output 5120 B) taking nothing;
- 1 x logits.sum() over [4, 256, 10000] taking 1536 + 4 B.
The last pins target_grid_size = 384 = sm_count * (max_threads_per_sm // 512): 128 SMs at 1536
threads (an Ada part such as the RTX 4090); its 8 MiB + 128 KiB cuBLAS workspace says non-Hopper
too. 132 SMs x 2048 threads would have given 2112 B.
"""

import pytest

from memo_ext.planner.cuda_reduce import plan_reduction, reduction_workspace

H100 = dict(sm_count=132, max_threads_per_sm=2048)
SNAPSHOT_GPU = dict(sm_count=128, max_threads_per_sm=1536)
FP32 = dict(input_itemsize=4, acc_itemsize=4, output_itemsize=4)
#: [4, 256, 1280] with the hidden dim outermost in memory, as in the snapshot.
HIDDEN_OUTER = ((4, 256, 1280), (256, 1, 1024))


def contiguous(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


@pytest.mark.parametrize("gpu", [SNAPSHOT_GPU, H100])
def test_snapshot_rms_gradient_reduction(gpu):
    # Coalesced: [1280 reduced (stride 4096 B), 1024 kept (stride 4 B)]: 1024 outputs of 1280
    # inputs, the reduced dim not the fastest -> vectorize along output: get_output_vec_size 4
    # (1024 % 4, 4096 / 4 % 4), dim0 = 1024 / 4 = 256. set_block_dimension with 512 / 4 = 128
    # threads: block 32 x 4. Lanes split outputs (step_output 32); 1280 >= min(4 * 16, 256), so
    # warps split inputs: values_per_thread 320. grid.x = 256 / 32 = 8. ctas_per_output =
    # max(min(ceil(target / 8), ceil(320 / 16) = 20), ceil(320 / 256) = 2) = 20 (target 1536 or
    # 2112). Buffer 4 * 1024 * 20 * (32 * 4) = 10485760; semaphores 4 * 8 = 32.
    shape, strides = HIDDEN_OUTER
    assert reduction_workspace(shape, strides, (2,), **FP32, **gpu,
                               torch_version=(2, 6)) == [10485760, 32]


def test_snapshot_gain_gradient_reduction_takes_nothing():
    # Reduced dims (0, 1) are the fastest (4 B and 1024 B, coalesced to 1024 of 4 B): block.x
    # reduces, vectorized by 4; block 32 x 16; values_per_thread 1024 / 32 = 32 < 256, so no
    # split across warps and no global reduction.
    shape, strides = HIDDEN_OUTER
    assert reduction_workspace(shape, strides, (0, 1), **FP32, **SNAPSHOT_GPU,
                               torch_version=(2, 6)) == []


@pytest.mark.parametrize("gpu, expected", [(SNAPSHOT_GPU, [1536, 4]), (H100, [2112, 4])])
def test_full_reduction_of_logits(gpu, expected):
    # [4, 256, 10000] (hidden-outer layout, coalesces to one dim of 10240000 x 4 B): all dims
    # reduced, vectorized by 4 (dim0 2560000); block 512 x 1; values_per_thread 10240000 / 512
    # = 20000. blocks per SM = threads per SM / 512: 3 (-> target 384) or 4 (-> 528).
    # ctas = max(min(target, 1250), 79) = target. Buffer 4 * 1 * ctas (block.x reduces, no
    # lane factor): 1536 or 2112; one semaphore, 4 B.
    assert reduction_workspace((4, 256, 10000), (256, 1, 1024), None, **FP32, **gpu,
                               torch_version=(2, 6)) == expected


def test_contiguous_sum_over_leading_dims():
    # The contiguous layout of the same gradient gives a different split: [1024 reduced (5120 B),
    # 1280 kept (4 B)]; output vectorization 4, dim0 320, block 32 x 4; values per thread 1024
    # / 4 = 256; grid.x = ceil(320 / 32) = 10; ctas = max(min(ceil(2112 / 10) = 212,
    # 256 / 16 = 16), 1) = 16. Buffer 4 * 1280 * 16 * 128 = 10485760; semaphores 4 * 10 = 40.
    shape = (4, 256, 1280)
    assert reduction_workspace(shape, contiguous(shape), (0, 1), **FP32, **H100,
                               torch_version=(2, 6)) == [10485760, 40]
    assert reduction_workspace(shape, contiguous(shape), (-3, -2), **FP32, **H100,
                               torch_version=(2, 13)) == [10485760, 40]


def test_large_full_reduction_to_a_scalar():
    # 2**24 fp32: block 512 x 1, values per thread 32768; target 132 * 4 = 528; ctas =
    # max(min(528, 2048), 128) = 528 -> 4 * 528 = 2112 B and one semaphore.
    n = 1 << 24
    assert reduction_workspace((n,), (1,), None, **FP32, **H100, torch_version=(2, 6)) \
        == [2112, 4]
    # The same elements as [4096, 4096] reduced over both dims coalesce to the same iterator.
    assert reduction_workspace((4096, 4096), (4096, 1), (0, 1), **FP32, **H100) == [2112, 4]


def test_last_dim_reduction_fits_one_block_per_output():
    # [1024, 1280] over the contiguous last dim: vectorized by 4 (dim0 320), block 32 x 16,
    # values per thread 1280 / 32 = 40 < 256: each row stays in one block.
    launch, = plan_reduction((1024, 1280), (1280, 1), (1,), **FP32, **H100,
                             torch_version=(2, 6)).launches
    assert (launch.block_x, launch.block_y, launch.ctas_per_output) == (32, 16, 1)
    assert launch.vectorize_input
    assert reduction_workspace((1024, 1280), (1280, 1), (1,), **FP32, **H100) == []


def test_small_tensor_and_empty_tensor():
    assert reduction_workspace((10,), (1,), None, **FP32, **H100) == []
    assert reduction_workspace((3, 5), (5, 1), (0,), **FP32, **H100) == []
    assert reduction_workspace((0, 5), (5, 1), (0,), **FP32, **H100) == []
    assert reduction_workspace((), (), None, **FP32, **H100) == []


def test_output_vectorization_follows_alignment():
    # [4096, 1280] over dim 0 (1280 outputs of 4096, the kept dim fastest).
    # Aligned: vec 4, dim0 320, block 32 x 4, values per thread 4096 / 4 = 1024, grid.x 10,
    # target 2112: ctas = max(min(212, 64), 4) = 64 -> 4 * 1280 * 64 * (32 * 4) = 41943040;
    # semaphores 40.
    shape, strides = (4096, 1280), (1280, 1)
    assert reduction_workspace(shape, strides, (0,), **FP32, **H100) == [41943040, 40]
    # Storage offset 2 elements: address % 4 != 0 -> vec 2; 256 threads: dim0 640, block 32 x 8;
    # values per thread 512; blocks per SM 8 -> target 1056; grid.x = 640 / 32 = 20; ctas =
    # max(min(53, 32), 2) = 32 -> 4 * 1280 * 32 * (32 * 2) = 10485760; semaphores 80.
    assert reduction_workspace(shape, strides, (0,), **FP32, **H100,
                               input_storage_offset=2) == [10485760, 80]
    # Odd offset -> vec 1: dim0 1280, block 32 x 16, values per thread 4096 / 16 = 256 >= 256;
    # blocks per SM 4 -> target 528; grid.x = 1280 / 32 = 40; ctas = max(min(14, 16), 1) = 14
    # -> 4 * 1280 * 14 * 32 = 2293760; semaphores 160.
    assert reduction_workspace(shape, strides, (0,), **FP32, **H100,
                               input_storage_offset=1) == [2293760, 160]


def test_pair_accumulator_of_max_with_indices():
    # max.dim over dim 0 of [4096, 1280] fp32: arg_t thrust::pair<float, int64_t> (16 B),
    # outputs values and int64 indices. Same launch as the aligned case above, 4x the bytes.
    assert reduction_workspace((4096, 1280), (1280, 1), (0,), input_itemsize=4,
                               acc_itemsize=16, output_itemsize=4, num_outputs=2,
                               second_output_itemsize=8, can_accumulate_in_output=False,
                               **H100) == [167772160, 40]


def test_iterator_split_for_32bit_indexing():
    # 2**30 fp32 elements span 4 GiB: split into two halves of 2**29 (max offset 2**31 - 3).
    # Each: block 512 x 1, values per thread 2**20, ctas = max(min(528, 65536), 4096) = 4096
    # -> 4 * 4096 = 16384 B and a semaphore. fp32 accumulates in its output: no extra buffer.
    n = 1 << 30
    plan = plan_reduction((n,), (1,), None, **FP32, **H100, torch_version=(2, 6))
    assert [launch.inputs_per_output for launch in plan.launches] == [n // 2, n // 2]
    assert plan.allocations == [16384, 4, 16384, 4]
    # An odd extent: split's copy (run first) takes the floor half; the other half, 2**29 + 1
    # elements (max offset 2**31 + 1), is split again, depth first.
    odd = plan_reduction((n + 1,), (1,), None, **FP32, **H100, torch_version=(2, 6))
    assert [launch.inputs_per_output for launch in odd.launches] \
        == [n // 2, n // 4, n // 4 + 1]
    # bf16 in and out cannot accumulate in the output: AccumulationBuffer of one fp32 (4 B)
    # first. 3 * 2**29 bf16: halves of 805306368; values per thread 1572864; ctas =
    # max(528, 6144) = 6144 -> 24576 B each.
    m = 3 << 29
    assert reduction_workspace((m,), (1,), None, input_itemsize=2, acc_itemsize=4,
                               output_itemsize=2, **H100,
                               torch_version=(2, 6)) == [4, 24576, 4, 24576, 4]


def test_input_vectorization_by_release():
    # [2, 512] fp16 summed over the last dim with vt0 4, input_vec_size 8 (current main's sum
    # of 16-bit types). 2.6: divisor fixed at 4 -> dim0 128 -> block.x 128. 2.7-2.9: vt0 < 8
    # turns it off -> dim0 512 -> block.x 256 (512 / block.y 2). 2.10+: dim0 512 / 8 = 64.
    args = ((2, 512), (512, 1), (1,))
    kw = dict(input_itemsize=2, acc_itemsize=4, output_itemsize=2, vt0=4, input_vec_size=8,
              **H100)
    widths = {version: plan_reduction(*args, **kw, torch_version=version).launches[0].block_x
              for version in ((2, 6), (2, 8), (2, 10))}
    assert widths == {(2, 6): 128, (2, 8): 256, (2, 10): 64}
    # dim0 exactly 128: "> 128" before 2.10, ">= 128" since.
    fp32 = dict(**FP32, **H100)
    old = plan_reduction((2, 128), (128, 1), (1,), **fp32, torch_version=(2, 9)).launches[0]
    new = plan_reduction((2, 128), (128, 1), (1,), **fp32, torch_version=(2, 10)).launches[0]
    assert (old.vectorize_input, old.block_x) == (False, 128)
    assert (new.vectorize_input, new.block_x) == (True, 32)


def test_refuses_what_it_cannot_answer():
    with pytest.raises(ValueError, match="2.4"):
        reduction_workspace((8,), (1,), None, **FP32, **H100, torch_version=(2, 3))
    with pytest.raises(ValueError):
        reduction_workspace((8, 8), (1,), None, **FP32, **H100)
    with pytest.raises(ValueError):
        reduction_workspace((8,), (1,), (1,), **FP32, **H100)
