"""The `memo-memory-report` command in a checkout: megatron.memo_tools.cli.memory_report.main."""
import sys

from megatron.memo_tools.cli.memory_report import main

if __name__ == "__main__":
    sys.exit(main())
