"""Megatron-FSDP (megatron-core 0.16.1's distributed/fsdp, --use-megatron-fsdp) on CPU torch.

SPIKE: shims collected while finding how far it gets.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh


class CpuDeviceMesh:
    """DeviceMesh as mcore_fsdp_adapter sees it: from_group with device_type 'cuda' -> 'cpu'."""

    @staticmethod
    def from_group(*args, device_type="cuda", **kwargs):
        return DeviceMesh.from_group(*args, device_type="cpu" if device_type == "cuda" else device_type,
                                     **kwargs)


def apply() -> None:
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    mcore_fsdp_adapter.DeviceMesh = CpuDeviceMesh
