"""The `memo-trace` command in a checkout: megatron.training.cli.trace.main."""
import sys

from megatron.training.cli.trace import main

if __name__ == "__main__":
    sys.exit(main())
