"""Pretrain a GPT model with megatron.core.

    torchrun --nproc-per-node 2 pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 \\
        --micro-batch-size 2 --global-batch-size 8 --lr 3e-4 --train-iters 100 --mock-data \\
        --vocab-size 4096

See README.md for the flags and examples/ for cluster scripts. The model provider and forward
step are megatron.training.gpt's. megatron.core is imported only after the command line
validated (see megatron.training.arguments), hence the local import.
"""

from __future__ import annotations

from functools import partial

from megatron.training.arguments import parse_args, run_main
from megatron.training.gpt import forward_step, model_provider


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    from megatron.training.training import pretrain

    pretrain(args, model_provider,
             partial(forward_step, packed_documents=args.reset_attention_mask))


if __name__ == "__main__":
    run_main(main)
