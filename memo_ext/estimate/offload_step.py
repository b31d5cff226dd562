"""The optimizer step of Megatron-LM's optimizer CPU offload (--optimizer-cpu-offload,
megatron-core 0.16.1's HybridDeviceOptimizer), predicted: its host Adam and its PCIe traffic,
overlapped as that optimizer's ``step`` orders them (docs/estimate.md "The time side").

What ``step`` does (megatron.core.optimizer.cpu_offloading.hybrid_optimizer), per offloaded
shard of n elements:

* D2H: the fp32 gradient shard into its host copy, 4n bytes over PCIe (``_set_sub_optimizer
  _grads``);
* host step: torch's AdamW (``fused=True``) on the host copy: it reads the parameter,
  gradient, exp_avg and exp_avg_sq and writes the parameter, exp_avg and exp_avg_sq, fp32:
  :data:`ADAM_BYTES_PER_ELEMENT` bytes of host memory traffic, at the node's host memory
  bandwidth shared by its ranks;
* H2D: the updated host copy into the model's parameter shard (the step's post hook), whose
  dtype it takes on the host first (``copy_`` across devices converts on the source side: an
  fp32 -> 16-bit pass, 6n bytes of host traffic) then ``element``·n bytes over PCIe.

The device part's step (the device Adam, ``device_step_s``) is queued on the compute stream
first. Without --overlap-cpu-optimizer-d2h-h2d every copy runs on the compute stream: the
gradients go down, then the device step and the host step run side by side (the host waits
only for the copies), and the parameters come back after both. With it, there is one host
optimizer per shard and each copy has a side stream: shard i's gradient copy, its host step
and its parameter copy form a three-stage pipeline over the shards, beside the device step,
except that a parameter copy waits for the compute stream, so for the device step
(``_h2d_stream.wait_stream(current_stream())``). On the CPU trainer nothing runs beside
anything (megatron.training.compat's streams are the calling thread): the sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

#: fp32 AdamW's host memory traffic per element: 4 tensors read, 3 written, 4 B each.
ADAM_BYTES_PER_ELEMENT = 7 * 4
#: An fp32 gradient element copied to the host.
GRADIENT_BYTES = 4
#: Host traffic of converting an fp32 host copy to a 16-bit parameter before its H2D copy.
CONVERSION_BYTES = 4 + 2


@dataclass(frozen=True)
class OffloadStep:
    """One optimizer step with offload, seconds: the whole (``step_s``, what the iteration
    waits for) and its parts' totals."""

    d2h_s: float
    host_s: float
    h2d_s: float
    device_s: float
    step_s: float


def offload_step(shards: Sequence[int], device_step_s: float, *, element: int,
                 pcie_bytes_per_s: float, host_bytes_per_s: float, overlap: bool,
                 concurrent: bool = True) -> OffloadStep:
    """The step of a rank whose offloaded shards have ``shards`` elements each (in the
    optimizer's order) and whose device part takes ``device_step_s``; ``element``: bytes of a
    model parameter (2 for bf16/fp16, 4 for fp32); ``host_bytes_per_s``: this rank's share of
    the host memory bandwidth; ``overlap``: --overlap-cpu-optimizer-d2h-h2d; ``concurrent``:
    False on the CPU trainer (everything in sequence)."""
    conversion = CONVERSION_BYTES if element < 4 else 0
    d2h = [GRADIENT_BYTES * n / pcie_bytes_per_s for n in shards]
    host = [ADAM_BYTES_PER_ELEMENT * n / host_bytes_per_s for n in shards]
    h2d = [element * n / pcie_bytes_per_s + conversion * n / host_bytes_per_s for n in shards]
    totals = (sum(d2h), sum(host), sum(h2d))
    if not concurrent:
        step = sum(totals) + device_step_s
    elif not overlap:
        down = totals[0]
        step = max(down + totals[1], down + device_step_s) + totals[2]
    else:
        down = up = done = 0.0
        for d, c, h in zip(d2h, host, h2d):
            down += d
            done = max(done, down) + c
            up = max(up, done, device_step_s) + h
        step = max(up, device_step_s)
    return OffloadStep(*totals, device_s=device_step_s, step_s=step)


__all__ = ["ADAM_BYTES_PER_ELEMENT", "OffloadStep", "offload_step"]
