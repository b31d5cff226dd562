"""Megatron-MEMO's training half of the ``megatron`` namespace (megatron.core comes from the
megatron-core wheel; there is deliberately no megatron/__init__.py).

Entry points import megatron.training.arguments first and the training stack (megatron.core,
several seconds to import) only after the command line validated, so a bad launch fails fast.
"""

import memo_ext  # noqa: E402,F401  (defers megatron-core's torch.compile decorations: memo_ext.lazy_fusions)
