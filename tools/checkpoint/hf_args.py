"""pretrain_gpt.py's model flags for a Hugging Face config.json:
megatron.memo_tools.hf_checkpoint.cli.hf_args_main.

    python tools/checkpoint/hf_args.py HF_MODEL_DIR
"""
import sys

from megatron.memo_tools.hf_checkpoint.cli import hf_args_main

if __name__ == "__main__":
    sys.exit(hf_args_main())
