"""megatron-core's Megatron-FSDP (distributed/fsdp, --use-megatron-fsdp) on CPU torch.

Megatron-FSDP's code is device-agnostic once megatron-core's CUDA placement is redirected
(compat.devices: its ``torch.cuda`` streams and events, ``device="cuda"`` factories, and
``torch.device(f"cuda:{torch.cuda.current_device()}")``, which the redirect answers with the
CPU). One CUDA name is left, passed to torch itself rather than through megatron-core's
``torch`` global, so the redirect cannot see it:

- :class:`MeshOnTheCpu` -- mcore_fsdp_adapter.FullyShardedDataParallel._init_dist_index builds
  its device mesh with ``DeviceMesh.from_group(..., device_type="cuda")``
  (mcore_fsdp_adapter.py:251, 265, 276). The mesh's device type is where DTensor puts the
  local tensors it is given (``DTensor.from_local`` moves them ``.to(device_type)``), so on CPU
  torch the first parameter it shards raises "Torch not compiled with CUDA enabled". On the
  GPU build the mesh's device is the device the model lives on; here the model lives on the
  CPU, so the mesh is a CPU mesh over the same process groups, ranks and dimension names.

The other CPU difference is a configuration value, set by megatron.training.megatron_fsdp
(``gradient_reduce_div_fusion``: gloo has no premultiplied sum). Applied by
compat.apply_cpu_shims, so on CUDA nothing here applies.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh


class MeshOnTheCpu:
    """``DeviceMesh`` as mcore_fsdp_adapter sees it: ``from_group`` with the CUDA device type
    builds the same mesh on the CPU; everything else is DeviceMesh's."""

    @staticmethod
    def from_group(*args, device_type: str = "cuda", **kwargs) -> DeviceMesh:
        return DeviceMesh.from_group(*args, device_type="cpu" if device_type == "cuda"
                                     else device_type, **kwargs)


def build_meshes_on_the_cpu() -> None:
    """Give mcore_fsdp_adapter :class:`MeshOnTheCpu` for its ``DeviceMesh`` global."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    mcore_fsdp_adapter.DeviceMesh = MeshOnTheCpu
