"""The `memo-trace` command in a checkout: megatron.memo_tools.cli.trace.main."""
import sys

from megatron.memo_tools.cli.trace import main

if __name__ == "__main__":
    sys.exit(main())
