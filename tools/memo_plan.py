"""The `memo-plan` command in a checkout: megatron.memo_tools.cli.memo_plan.main."""
import sys

from megatron.memo_tools.cli.memo_plan import main

if __name__ == "__main__":
    sys.exit(main())
