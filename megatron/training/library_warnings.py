"""megatron-core's import-time notices that Transformer Engine and Apex are missing, and the
filter that hides them (only those, matched by text). megatron-core warns four times at import
(optimizer, clip_grads, FSDP mixed precision); on the CPU, where the trainer and the tools run
torch's kernels, that is the expected state and the notices would bury real errors.

Light on purpose (stdlib only): megatron.training.arguments.run_main applies the filter on CPU
before the training stack is imported, and the tools (megatron.memo_tools.cli.quiet) apply it
before their first import of megatron.core.
"""

from __future__ import annotations

import warnings

#: megatron-core's import-time notices that Apex/Transformer Engine are missing.
MISSING_TE_APEX = r".*(Apex|Transformer Engine).* not installed"


def hide_library_warnings() -> None:
    """Filter megatron-core's 'Transformer Engine and Apex are not installed' warnings (only
    those, matched by text) in this process."""
    warnings.filterwarnings("ignore", message=MISSING_TE_APEX)
