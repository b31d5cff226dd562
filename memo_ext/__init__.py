"""Megatron-MEMO long-context mechanisms. Each subpackage has one public entry point; nothing here imports megatron.training."""
