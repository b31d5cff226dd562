"""The `memo-estimate` command in a checkout: megatron.memo_tools.cli.estimate.main."""
import sys

from megatron.memo_tools.cli.estimate import main

if __name__ == "__main__":
    sys.exit(main())
