"""Sequence-tiled MLP: measured peak bytes of one MLP's forward + backward vs sequence length,
megatron.core's MLP against memo_ext.tiled_mlp.TiledMLP, with the time each takes.

    python bench/tiled_mlp_memory.py                        # h 256, ffn 1024, tile 1024
    python bench/tiled_mlp_memory.py --seq 4096 16384 --tile 1024 -o bench/results

One process, TP=1, fp32, micro-batch 1, CPU. Both MLPs get the same weights and the same
[s, 1, h] input and output gradient. Under :class:`memo_ext.storage_tracker.DeviceMemoryTracker`
(which counts every storage an op creates until it is freed), the "working set" is the peak of
the bytes allocated during forward + backward: the input, the output gradient and the
parameters existed before and are not counted; the output, the input gradient and the
parameter gradients are. The hidden-wide part ([s, h]: output, input gradient) grows with s in
both; the ffn-wide part ([s, ffn]: fc1's and the activation's outputs, saved for backward, and
their gradients) grows with s untiled and stays one tile's with tiling.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MiB = 1 << 20


def measure(mlp, seq: int, hidden: int) -> tuple[int, float]:
    """(peak bytes allocated during forward + backward, seconds)."""
    import torch

    from memo_ext.storage_tracker import DeviceMemoryTracker

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(seq, 1, hidden, generator=generator).requires_grad_()
    grad = torch.randn(seq, 1, hidden, generator=generator)
    mlp.zero_grad(set_to_none=True)
    tracker = DeviceMemoryTracker()
    start = time.perf_counter()
    with tracker:
        output, _ = mlp(x)
        output.backward(grad)
    return tracker.stats()["peak_device_bytes"], time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--tile", type=int, default=1024, help="--memo-mlp-tile-size")
    parser.add_argument("-o", "--output-dir", default=None,
                        help="Also write tiled_mlp_memory.md there.")
    opts = parser.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore")
    import torch
    import torch.nn.functional as F
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_megatron
    from memo_ext.tiled_mlp import TiledMLP

    # One gloo rank: megatron's linear layers need its (TP size 1) process groups.
    initialize_megatron(parse_args(
        ["--num-layers", "1", "--hidden-size", str(opts.hidden), "--num-attention-heads", "8",
         "--seq-length", str(max(opts.seq)), "--micro-batch-size", "1", "--train-iters", "1",
         "--lr", "1e-4", "--mock-data", "--vocab-size", "512"], world_size=1, cuda_available=False))
    config = TransformerConfig(
        num_layers=1, hidden_size=opts.hidden, num_attention_heads=8, ffn_hidden_size=opts.ffn,
        use_cpu_initialization=True, activation_func=F.gelu, bias_activation_fusion=False)
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    torch.manual_seed(0)
    untiled = MLP(config, submodules, ffn_hidden_size=opts.ffn)
    tiled = TiledMLP(config, submodules, tile_tokens=opts.tile, ffn_hidden_size=opts.ffn)
    tiled.load_state_dict(untiled.state_dict())

    lines = [f"MLP forward + backward, h {opts.hidden}, ffn {opts.ffn}, fp32, micro-batch 1, "
             f"tile {opts.tile} tokens (`python bench/tiled_mlp_memory.py --hidden {opts.hidden} "
             f"--ffn {opts.ffn} --tile {opts.tile} --seq {' '.join(map(str, opts.seq))}`)", "",
             "| s | untiled peak MiB | tiled peak MiB | ratio | untiled s | tiled s |",
             "|---:|---:|---:|---:|---:|---:|"]
    for seq in opts.seq:
        peak_untiled, time_untiled = measure(untiled, seq, opts.hidden)
        peak_tiled, time_tiled = measure(tiled, seq, opts.hidden)
        lines.append(f"| {seq} | {peak_untiled / MiB:.1f} | {peak_tiled / MiB:.1f} | "
                     f"{peak_tiled / peak_untiled:.3f} | {time_untiled:.2f} | {time_tiled:.2f} |")
    tile_bytes, hidden_bytes = opts.tile * opts.ffn * 4, opts.seq[-1] * opts.hidden * 4
    lines += ["", f"One tile's [T, ffn] fp32 intermediate: {tile_bytes / MiB:.1f} MiB; one "
              f"[s, h] tensor at s = {opts.seq[-1]}: {hidden_bytes / MiB:.1f} MiB. Times are "
              "wall seconds under the tracker's dispatch mode on this CPU: no speed measurement."]
    text = "\n".join(lines)
    print(text)
    if opts.output_dir:
        path = Path(opts.output_dir) / "tiled_mlp_memory.md"
        path.write_text(text + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
