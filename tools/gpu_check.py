"""The `memo-gpu-check` command (`make gpu-check`) in a checkout:
megatron.memo_tools.gpu_check.check.main. See docs/gpu_check.md."""
import sys

from megatron.memo_tools.gpu_check.check import main

if __name__ == "__main__":
    sys.exit(main())
