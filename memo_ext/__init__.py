"""Megatron-MEMO long-context mechanisms. Each subpackage has one public entry point; nothing here imports megatron.training."""

from memo_ext.lazy_fusions import install as _install_lazy_fusions

# Before anything imports megatron.core: its torch.compile decorations cost 2.6 s a process.
_install_lazy_fusions()
