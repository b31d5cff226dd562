"""The smallest shims that let megatron-core 0.16.1 train on CPU torch with gloo.

Applied by megatron.training.initialize only when CUDA is absent. Each shim names the
megatron.core symbol it replaces:

- devices.py: the ``torch`` global of every megatron.core module (``device="cuda"``,
  ``torch.cuda.current_device()``, streams, events, synchronize) -> CPU; ``Tensor.cuda()`` ->
  identity.
- rng.py: tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state -> CPU generator.
- clip_grads.py: optimizer.optimizer.clip_grad_by_total_norm_fp32 (asserts CUDA grads).
- distrib_optimizer.py: optimizer.distrib_optimizer.DistributedOptimizer.__init__ (sorts
  parameters by their ``type()``, whose names it expects to be CUDA's).
- hybrid_optimizer.py: optimizer.cpu_offloading.HybridDeviceOptimizer (--optimizer-cpu-offload:
  its device/host split asks ``is_cuda`` and pins its host copies), optimizer_config's
  ``is_te_min_version`` (raises without Transformer Engine), and the two places where the
  offload path assumes 16-bit parameters.
- megatron_fsdp.py: distributed.fsdp.mcore_fsdp_adapter's ``DeviceMesh`` (--use-megatron-fsdp
  builds its mesh with device type 'cuda'); devices.py's ``torch.device`` answers its
  ``torch.device(f"cuda:{torch.cuda.current_device()}")`` with the CPU.
- gloo_coalescing.py: distributed.param_and_grad_buffer's and Megatron-FSDP's
  ``_coalescing_manager``: torch's gloo corrupts the heap under an asynchronous coalesced
  all-gather, so on gloo those all-gathers are issued one by one.
- norm.py: transformer.torch_norm.WrappedTorchNorm in the layer spec (refuses sequence parallel).
- attention.py: transformer.dot_product_attention.DotProductAttention in the layer spec
  (refuses context parallel; materialises s x s scores).

The last two are spec substitutions (see megatron.training.layer_specs), used wherever
Transformer Engine is absent, on CPU and GPU alike.
"""

from __future__ import annotations

import importlib

from megatron.core import package_info

SUPPORTED_MEGATRON_CORE_VERSION = "0.16.1"

# Every megatron.core module on the training path must be imported before the device redirect,
# which patches loaded modules only.
_TRAINING_PATH_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.utils",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.tensor_parallel.data",
    "megatron.core.models.gpt",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.attention",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.cpu_offloading.hybrid_optimizer",
    "megatron.core.optimizer.optimizer_config",
    "megatron.core.optimizer_param_scheduler",
    "megatron.core.distributed.fsdp.mcore_fsdp_adapter",
    "megatron.core.dist_checkpointing",
    "megatron.core.rerun_state_machine",
    "megatron.core.num_microbatches_calculator",
)

_applied = False


def check_megatron_core_version() -> None:
    """Refuse to run against a megatron-core the shims were not written for."""
    if package_info.__version__ != SUPPORTED_MEGATRON_CORE_VERSION:
        raise RuntimeError(
            f"megatron-core {package_info.__version__} is installed but Megatron-MEMO's shims "
            f"were written against {SUPPORTED_MEGATRON_CORE_VERSION}; run "
            f"`pip install megatron-core=={SUPPORTED_MEGATRON_CORE_VERSION}`"
        )


def apply_cpu_shims() -> None:
    """Apply every CPU shim once per process (idempotent)."""
    global _applied
    if _applied:
        return
    check_megatron_core_version()
    for module_name in _TRAINING_PATH_MODULES:
        importlib.import_module(module_name)
    from megatron.training.compat.clip_grads import use_cpu_grad_clipping
    from megatron.training.compat.devices import (
        keep_tensors_on_cpu,
        redirect_megatron_core_devices,
    )
    from megatron.training.compat import hybrid_optimizer
    from megatron.training.compat.distrib_optimizer import sort_cpu_parameters_as_cuda
    from megatron.training.compat.gloo_coalescing import issue_gloo_all_gathers_one_by_one
    from megatron.training.compat.megatron_fsdp import build_meshes_on_the_cpu
    from megatron.training.compat.rng import use_cpu_generator_in_rng_tracker

    redirect_megatron_core_devices()
    keep_tensors_on_cpu()
    use_cpu_generator_in_rng_tracker()
    use_cpu_grad_clipping()
    sort_cpu_parameters_as_cuda()
    hybrid_optimizer.apply()
    build_meshes_on_the_cpu()
    issue_gloo_all_gathers_one_by_one()
    _applied = True
