"""Megatron-MEMO's training half of the ``megatron`` namespace (megatron.core comes from the
megatron-core wheel; there is deliberately no megatron/__init__.py)."""

from megatron.training.arguments import parse_args
from megatron.training.training import pretrain, run_main

__all__ = ["parse_args", "pretrain", "run_main"]
