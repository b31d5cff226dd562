"""Megatron-MEMO's tools, beside the trainer (megatron.training) in the ``megatron`` namespace
(megatron.core comes from the megatron-core wheel; there is deliberately no
megatron/__init__.py):

- ``cli``: the installed ``memo-*`` commands (trace, memo_plan, estimate, memory_report,
  sppo_plan) and what they hide of their libraries' output (``quiet``);
- ``hf_checkpoint``: Hugging Face checkpoints to the trainer's and back;
- ``long_context_eval``: perplexity by position and passkey retrieval of a checkpoint;
- ``gpu_check``: ``memo-gpu-check``, the GPU tests and trainings against the estimator.

The tools import the trainer and memo_ext; the trainer imports nothing from here.
"""

import memo_ext  # noqa: E402,F401  (defers megatron-core's torch.compile decorations: memo_ext.lazy_fusions)
