"""The `memo-sppo-plan` command in a checkout: megatron.memo_tools.cli.sppo_plan.main."""
import sys

from megatron.memo_tools.cli.sppo_plan import main

if __name__ == "__main__":
    sys.exit(main())
