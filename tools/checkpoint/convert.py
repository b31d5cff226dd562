"""Hugging Face <-> trainer checkpoints: megatron.memo_tools.hf_checkpoint.cli.convert_main.

    python tools/checkpoint/convert.py --loader hf --saver core --load-dir HF --save-dir CKPT
    python tools/checkpoint/convert.py --loader core --saver hf --load-dir CKPT --save-dir HF2
"""
import sys

from megatron.memo_tools.hf_checkpoint.cli import convert_main

if __name__ == "__main__":  # dist_checkpointing's writer starts processes that import __main__
    sys.exit(convert_main())
