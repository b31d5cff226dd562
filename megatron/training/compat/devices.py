"""Redirect megatron.core's hard-coded CUDA device placement to the CPU.

megatron-core 0.16.1 creates tensors with ``device=torch.cuda.current_device()`` or
``device="cuda"`` in many places (GlobalMemoryBuffer.get_tensor, tensor_parallel.mappings'
gathers -- also inside autograd backward --, pipeline_parallel.p2p_communication and
schedules, optimizer.clip_grads, distributed.param_and_grad_buffer) and calls
``torch.cuda.synchronize/Stream/default_stream``. A TorchFunctionMode cannot catch the calls
made inside autograd backward, so instead each loaded ``megatron.core.*`` module gets its
``torch`` global replaced by :data:`CPU_TORCH`, a proxy that forwards everything to ``torch``
except ``torch.cuda`` (a CPU stand-in), the factory functions (device arguments naming
CUDA become ``cpu``) and ``torch.device`` (naming CUDA, it is the CPU: Megatron-FSDP's
``torch.device(f"cuda:{torch.cuda.current_device()}")``). The real ``torch`` module is left
alone with one exception:
``Tensor.cuda()`` is a method, reached without any module global (LanguageModule.
setup_embeddings_and_output_layer with PP>1, the optimizer's state loading,
tensor_parallel.data.broadcast_data, dist_checkpointing.exchange_utils), so on a build without
CUDA -- where it could only raise -- :func:`keep_tensors_on_cpu` makes it return the tensor
unchanged.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import types
from contextlib import nullcontext

import torch

_CPU = torch.device("cpu")

# Functions megatron.core calls with an explicit device argument.
_FACTORY_FUNCTIONS = (
    "empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint",
    "empty_like", "zeros_like", "ones_like", "full_like", "as_tensor", "eye", "linspace",
)


def _to_cpu_device(device):
    """Map any CUDA device spelling (int index, 'cuda', 'cuda:1', torch.device) to cpu."""
    if device is None:
        return None
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _redirect_device(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return wrapper


class _NullEvent:
    """Stands in for torch.cuda.Event: CPU ops are synchronous, so by the time an event is
    recorded the work before it is done; waits return at once and ``query()`` is True."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


class _NullStream:
    """Stands in for torch.cuda.Stream: CPU ops are synchronous, so waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        """As torch.cuda.Stream.record_event: records ``event``, or a new one, and returns it
        (HybridDeviceOptimizer waits on the event its copy stream returns)."""
        return _NullEvent() if event is None else event

    def synchronize(self):
        pass


class _CpuCudaNamespace(types.SimpleNamespace):
    """The subset of ``torch.cuda`` that megatron.core's training path calls, answered for CPU."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


CPU_CUDA = _CpuCudaNamespace(
    current_device=lambda: _CPU,
    device_count=lambda: 0,
    synchronize=lambda *args, **kwargs: None,
    empty_cache=lambda: None,
    Stream=_NullStream,
    Event=_NullEvent,
    stream=lambda stream=None: nullcontext(),
    default_stream=lambda *args, **kwargs: _NullStream(),
    current_stream=lambda *args, **kwargs: _NullStream(),
    get_rng_state=lambda *args, **kwargs: torch.get_rng_state(),
    set_rng_state=lambda state, *args, **kwargs: torch.set_rng_state(state),
    manual_seed=lambda seed: torch.manual_seed(seed),
    memory_allocated=lambda *args, **kwargs: 0,
    max_memory_allocated=lambda *args, **kwargs: 0,
    memory_reserved=lambda *args, **kwargs: 0,
    max_memory_reserved=lambda *args, **kwargs: 0,
    reset_peak_memory_stats=lambda *args, **kwargs: None,
    is_available=lambda: False,
    nvtx=types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None),
)


class _CudaDeviceIsCpuMeta(type):
    """``isinstance(x, <the stand-in>)`` answers as ``isinstance(x, torch.device)``."""

    def __instancecheck__(cls, instance):
        return isinstance(instance, torch.device)

    def __call__(cls, *args, **kwargs):
        """``torch.device(...)`` naming CUDA in any spelling (``"cuda"``, ``"cuda:0"``,
        ``("cuda", index)``, and ``f"cuda:{torch.cuda.current_device()}"``, which reads
        ``"cuda:cpu"`` here because :data:`CPU_CUDA`'s current device is the CPU) -> cpu."""
        if args and isinstance(args[0], str) and args[0].startswith("cuda"):
            return _CPU
        return torch.device(*args, **kwargs)


class _DeviceNamingCudaIsCpu(metaclass=_CudaDeviceIsCpuMeta):
    """``torch.device`` as seen by a patched module. Megatron-FSDP names its device
    ``torch.device(f"cuda:{torch.cuda.current_device()}")`` (megatron_fsdp.py:182-188) and
    asks a process group for its backend by ``torch.device("cuda", ...)``
    (param_and_grad_buffer.py:217, 230). On the GPU build that is the device megatron-core's
    tensors live on; here they live on the CPU (the factories above), so it is the CPU, and the
    backend asked for is gloo's."""


class _CpuTorchProxy(types.ModuleType):
    """``torch`` as seen by a patched megatron.core module."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = CPU_CUDA
        self.device = _DeviceNamingCudaIsCpu
        for name in _FACTORY_FUNCTIONS:
            setattr(self, name, _redirect_device(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


CPU_TORCH = _CpuTorchProxy()


def _redirect_module(module: types.ModuleType) -> bool:
    if getattr(module, "torch", None) is torch:
        module.torch = CPU_TORCH
        return True
    return False


class _RedirectOnImport(importlib.abc.MetaPathFinder):
    """Applies the redirect to megatron.core modules imported after the shims (for example
    dist_checkpointing's save strategies, loaded lazily at the first save)."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("megatron.core."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        original_exec = spec.loader.exec_module

        def exec_then_redirect(module):
            original_exec(module)
            _redirect_module(module)

        spec.loader.exec_module = exec_then_redirect
        return spec


def redirect_megatron_core_devices() -> list[str]:
    """Point the ``torch`` global of every ``megatron.core`` module, loaded now or later, at
    :data:`CPU_TORCH`. Returns the names of the modules patched now."""
    patched = [
        name
        for name, module in list(sys.modules.items())
        if name.startswith("megatron.core") and module is not None and _redirect_module(module)
    ]
    if not any(isinstance(finder, _RedirectOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RedirectOnImport())
    return patched


def _tensor_cuda_on_cpu(self: torch.Tensor, device=None, non_blocking: bool = False, **kwargs):
    return self


def keep_tensors_on_cpu() -> None:
    """Make ``Tensor.cuda()`` a no-op; refuses to run where CUDA exists."""
    if torch.cuda.is_available():
        raise RuntimeError("keep_tensors_on_cpu is a CPU-only shim but CUDA is available")
    torch.Tensor.cuda = _tensor_cuda_on_cpu
