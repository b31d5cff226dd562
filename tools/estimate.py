"""The `memo-estimate` command in a checkout: megatron.training.cli.estimate.main."""
import sys

from megatron.training.cli.estimate import main

if __name__ == "__main__":
    sys.exit(main())
