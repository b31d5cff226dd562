"""``make gpu-check``: the GPU tests, then a 10-iteration training of each mechanism on the GPUs
present, measured beside the estimator's prediction, in a markdown report.

    python tools/gpu_check.py [--out gpu_check_report.md] [--gpus N] [--mechanisms a,b]

Exit status 0 when every row that ran passed, 1 when one failed, 2 without a CUDA GPU (one
line). The logic is megatron/training/gpu_check/; docs/gpu_check.md describes the report.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from megatron.training.gpu_check.check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
