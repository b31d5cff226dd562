"""The `memo-sppo-plan` command in a checkout: megatron.training.cli.sppo_plan.main."""
import sys

from megatron.training.cli.sppo_plan import main

if __name__ == "__main__":
    sys.exit(main())
