"""MEMO's linear program for alpha, the fraction of tokens of the alpha-split tensors offloaded.

Per pipeline stage (docs/memo.md "Choosing alpha (LP)", extended for pipelining and page-locked
memory)::

    max alpha
    s.t. (S_in + S_attn + X + alpha*S_oth) / B <= T_layer          # copy hides under compute
         N * cost(S_in + S_attn + X + alpha*S_oth) <= M_host        # host memory
         R*(X + alpha*S_oth) <= D_free                             # device memory (optional)
         0 <= alpha <= 1

* ``S_in``, ``S_attn``: bytes per layer per micro-batch of the tensors always offloaded whole
  (layer input, attention output); ``S_oth``: bytes of the alpha-split tensors; ``X``: bytes a
  slot stores on top at 0 < alpha < 1 only (``AlphaInputs.interior_extra_bytes``), counted at
  every alpha, which is conservative at alpha = 1 only.
* ``B``: device->host bytes/s per rank (measured with all ranks of the node copying at once);
  ``T_layer``: seconds of one layer's forward.
* ``N = (n - 2) * k`` host slots: ``n`` layers on this stage, of which the last two are never
  offloaded, times ``k`` micro-batches in flight on this stage (:func:`microbatches_in_flight`).
* ``M_host``: host bytes this rank may use (:func:`default_host_memory_bytes`).
* ``D_free``: device bytes left unused at the peak of the measuring iteration, which runs at
  alpha = 0. Raising alpha grows each of the ``R`` rounding buffers (2, or 1 with
  ``--memo-offload-buffers 1``), which hold one slot each, by ``X + alpha*S_oth``; the one
  layer being recomputed shrinks by as much, but the iteration's peak need not fall while a
  layer is recomputed (measured on CPU: it sits where both buffers are full and the head's
  logits are live), so the peak grows by up to ``R*(X + alpha*S_oth)``. The paper's LP has no
  device row: it maximises offloading, which is cheapest in time, but at the longest sequences
  alpha = 1 is the configuration that runs out of device memory. With an explicit budget
  ``M_dev`` for MEMO's activations (``--memo-device-memory-gb``: the buffers plus one layer's
  recompute working set) the row is ``R*(S_in + S_attn) + S_oth + R*(X + alpha*S_oth) <= M_dev``
  instead.
  With one buffer the copies are not hidden at all (each waits, memo_ext.offload.manager); the
  bandwidth row then still bounds one copy by one layer's forward, and at the lengths one buffer
  is for, the host row holds alpha near 0 anyway.
  Without either (no way to read the device's capacity, e.g. the CPU stand-in without a
  simulated cap) the row is left out.

Counting host bytes (``cost``). The host arena is allocated as one buffer per
(layer, in-flight micro-batch) slot, each slot holding one layer's offloaded bytes
``S(alpha) = S_in + S_attn + ceil(alpha * S_oth)``. With ``page_locked`` (CUDA) the slot is
page-locked at its own size (memo_ext.device, ``CopyEngine.alloc_host``), which takes whole
pages, so it costs ``page_locked_bytes(S(alpha))``: ``S`` rounded up to HOST_PAGE_BYTES
(memo_ext.host_pages); without it (CPU) a slot costs ``S(alpha)``. The ceiling makes the
count conservative: an offload manager that sends ``floor(alpha * s)`` of ``s`` tokens to host
never needs more than the slot it was sized for.

The closed form (:func:`solve_alpha`) is exact, rounding included: a slot fits a per-slot budget
``P = M_host // N`` iff ``page_locked_bytes(S) <= P`` iff ``S <= P`` rounded down to a whole
page, which is again linear in alpha. :func:`solve_alpha_lp` solves the same LP (without
rounding) with HiGHS so the tests can cross-check it.

If even alpha = 0 does not fit host memory, the decision says so
(``host_bytes_missing_at_alpha0 > 0``) and the caller must fall back to recomputing instead of
offloading; nothing here raises for it.
"""

from __future__ import annotations

import math
from typing import Optional
from dataclasses import dataclass

from memo_ext.host_pages import HOST_PAGE_BYTES, page_locked_bytes

#: Bytes per GB in logs (10**9, the convention of PCIe GB/s figures).
_GB = 1e9

#: Values of :attr:`AlphaDecision.limited_by`.
LIMITED_BY_BANDWIDTH = "bandwidth"
LIMITED_BY_HOST_MEMORY = "host_memory"
LIMITED_BY_DEVICE_MEMORY = "device_memory"
LIMITED_BY_NOTHING = "none"  # alpha = 1: every token offloaded, both constraints slack


@dataclass(frozen=True)
class AlphaInputs:
    """Inputs of the alpha LP for one rank (all sizes per layer per micro-batch, per rank).

    Attributes:
        input_bytes: S_in, bytes of the layer input (always offloaded whole).
        attention_output_bytes: S_attn, bytes of the attention output (always offloaded whole).
        other_bytes: S_oth, bytes of all alpha-split saved tensors at alpha = 1.
        bandwidth_bytes_per_s: B, device->host copy bandwidth per rank, bytes/s (> 0).
        layer_forward_s: T_layer, one layer's forward time, seconds (>= 0).
        host_memory_bytes: M_host, host bytes this rank may use for offloaded activations.
        offloaded_layers: n - 2 for a stage of n layers, never negative
            (see :func:`offloaded_layers`).
        microbatches_in_flight: k, micro-batches whose activations are held at once on this
            stage (see :func:`microbatches_in_flight`), >= 1.
        page_locked: count each (layer, micro-batch) slot as its bytes rounded up to whole
            pages (True on CUDA, where the slots are page-locked at their own size).
        device_memory_bytes: optional device budget M_dev for MEMO's activations: the R
            rounding buffers plus one layer's recompute working set at alpha = 0
            (R*(S_in + S_attn) + S_oth), plus R*alpha*S_oth for the buffers' growth with alpha.
            None: fall back to ``device_headroom_bytes``.
        device_headroom_bytes: D_free, device bytes left unused at the peak of the measuring
            iteration (run at alpha = 0); caps alpha at D_free / (R*S_oth). Used only when
            ``device_memory_bytes`` is None. None: no device constraint (the paper's LP).
        interior_extra_bytes: bytes a slot stores on top at 0 < alpha < 1 only: under sequence
            parallelism the attention output is stored a second time there, in the kept/dropped
            token order, besides the core attention's saved output (at alpha 0 and 1 the orders
            agree and one copy serves both).
        rounding_buffers: R, the device buffers offloaded data passes through (2, or 1 with
            ``--memo-offload-buffers 1``).
    """

    input_bytes: int
    attention_output_bytes: int
    other_bytes: int
    bandwidth_bytes_per_s: float
    layer_forward_s: float
    host_memory_bytes: int
    offloaded_layers: int
    microbatches_in_flight: int
    page_locked: bool
    device_memory_bytes: Optional[int] = None
    device_headroom_bytes: Optional[int] = None
    interior_extra_bytes: int = 0
    rounding_buffers: int = 2

    def __post_init__(self) -> None:
        for name in ("input_bytes", "attention_output_bytes", "other_bytes", "host_memory_bytes",
                     "offloaded_layers"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"AlphaInputs.{name} must be >= 0, got {value}")
        if self.microbatches_in_flight < 1:
            raise ValueError("AlphaInputs.microbatches_in_flight must be >= 1, got "
                             f"{self.microbatches_in_flight}")
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError("AlphaInputs.bandwidth_bytes_per_s must be > 0, got "
                             f"{self.bandwidth_bytes_per_s}")
        if not self.layer_forward_s >= 0:
            raise ValueError(f"AlphaInputs.layer_forward_s must be >= 0, got {self.layer_forward_s}")
        if self.rounding_buffers not in (1, 2):
            raise ValueError(f"AlphaInputs.rounding_buffers must be 1 or 2, got "
                             f"{self.rounding_buffers}")

    @property
    def whole_bytes(self) -> int:
        """S_in + S_attn: bytes per slot offloaded regardless of alpha."""
        return int(self.input_bytes) + int(self.attention_output_bytes)

    @property
    def host_slots(self) -> int:
        """N = (n - 2) * k: host slots of this rank's arena."""
        return int(self.offloaded_layers) * int(self.microbatches_in_flight)

    def slot_bytes(self, alpha: float) -> int:
        """Offloaded bytes of one (layer, micro-batch) at ``alpha``: S_in + S_attn +
        ceil(alpha*S_oth), plus the interior extra when 0 < alpha < 1."""
        extra = self.interior_extra_bytes if 0.0 < alpha < 1.0 else 0
        return self.whole_bytes + extra + math.ceil(alpha * self.other_bytes)

    def slot_cost_bytes(self, alpha: float) -> int:
        """Host bytes one slot occupies at ``alpha`` (whole pages if page_locked)."""
        nbytes = self.slot_bytes(alpha)
        return page_locked_bytes(nbytes) if self.page_locked else nbytes

    def host_bytes_needed(self, alpha: float) -> int:
        """Host bytes of the whole arena at ``alpha``: N * slot cost."""
        return self.host_slots * self.slot_cost_bytes(alpha)

    def fits_host(self, alpha: float) -> bool:
        """Whether the arena at ``alpha`` fits M_host (the host constraint, rounding included)."""
        return self.host_bytes_needed(alpha) <= self.host_memory_bytes


@dataclass(frozen=True)
class AlphaDecision:
    """The chosen alpha and why.

    Attributes:
        alpha: chosen fraction in [0, 1] (satisfies the host constraint, rounding included, unless
            even 0 does not fit; then 0 and ``host_bytes_missing_at_alpha0 > 0``).
        bandwidth_bound: unclipped largest alpha whose copy hides under one layer's forward
            ((B*T_layer - S_in - S_attn) / S_oth; +-inf when S_oth = 0).
        host_memory_bound: unclipped largest alpha whose arena fits host memory (+inf when no
            layer is offloaded; +-inf when S_oth = 0).
        limited_by: ``"bandwidth"``, ``"host_memory"`` (the smaller bound, which set alpha < 1)
            or ``"none"`` (alpha = 1).
        host_bytes_needed: host bytes of the arena at ``alpha`` (rounding included if on).
        host_bytes_missing_at_alpha0: bytes M_host lacks even at alpha = 0 (0 if it fits); > 0
            means: do not offload, recompute instead.
    """

    alpha: float
    bandwidth_bound: float
    host_memory_bound: float
    limited_by: str
    host_bytes_needed: int
    host_bytes_missing_at_alpha0: int
    device_memory_bound: float = math.inf

    @property
    def fits_host_memory(self) -> bool:
        """False when even alpha = 0 overflows host memory (fall back to recomputation)."""
        return self.host_bytes_missing_at_alpha0 == 0


def offloaded_layers(layers_per_stage: int, kept_on_device: int = 2) -> int:
    """n - 2 (never negative): layers of a stage whose activations go to host memory; n - 1
    with one rounding buffer (``kept_on_device``: one kept layer per buffer)."""
    if layers_per_stage < 0:
        raise ValueError(f"layers_per_stage must be >= 0, got {layers_per_stage}")
    return max(0, layers_per_stage - kept_on_device)


def microbatches_in_flight(pipeline_rank: int, pipeline_size: int, num_microbatches: int) -> int:
    """k: micro-batches whose activations one stage holds at once under 1F1B.

    1 without pipelining (each micro-batch's backward follows its forward). With 1F1B, stage
    ``p`` of ``P`` runs ``P - p - 1`` warm-up forwards plus one before its first backward, so
    ``min(P - p, num_microbatches)`` micro-batches are in flight.
    """
    if pipeline_size < 1:
        raise ValueError(f"pipeline_size must be >= 1, got {pipeline_size}")
    if not 0 <= pipeline_rank < pipeline_size:
        raise ValueError(f"pipeline_rank must be in [0, {pipeline_size}), got {pipeline_rank}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    return min(pipeline_size - pipeline_rank, num_microbatches)


def default_host_memory_bytes(local_world_size: int) -> int:
    """Default M_host: host memory available now (psutil) / ranks on this node, bytes."""
    import psutil

    if local_world_size < 1:
        raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
    return int(psutil.virtual_memory().available) // int(local_world_size)


def _bound(budget_bytes: float, inputs: AlphaInputs) -> float:
    """Largest alpha with S_in + S_attn + alpha*S_oth <= budget (unclipped, +-inf if S_oth = 0),
    counting the interior extra (conservative at alpha 1, where it is not stored)."""
    spare = budget_bytes - inputs.whole_bytes - inputs.interior_extra_bytes
    if inputs.other_bytes == 0:
        return math.inf if spare >= 0 else -math.inf
    return spare / inputs.other_bytes


def _host_bound(inputs: AlphaInputs) -> float:
    """Unclipped host-memory bound on alpha, exact under the slot-cost model (module docstring)."""
    slots = inputs.host_slots
    if slots == 0:
        return math.inf
    # All slots are equal, so N * cost(S) <= M  <=>  cost(S) <= M // N (integers).
    per_slot = int(inputs.host_memory_bytes) // slots
    if inputs.page_locked:
        # S rounded up to a page <= per_slot  <=>  S <= per_slot rounded down to a page.
        per_slot -= per_slot % HOST_PAGE_BYTES
    # The budget is an integer, so whole + ceil(alpha*S_oth) <= budget  <=>
    # alpha*S_oth <= budget - whole. (Versus the continuous LP bound (M/N - whole)/S_oth this
    # loses less than 1/S_oth.)
    return _bound(per_slot, inputs)


def _device_bound(inputs: AlphaInputs) -> float:
    """Largest alpha with R*W + S + R*(X + alpha*S) <= M_dev, i.e. (M_dev - R*W - S - R*X)/(R*S),
    or, measured, R*(X + alpha*S) <= D_free (module docstring); +inf with neither. X, the
    interior extra, is counted as in :func:`_bound`: each rounding buffer holds a whole slot,
    extra included (conservative at alpha 1, where it is not stored)."""
    buffers = inputs.rounding_buffers
    if inputs.device_memory_bytes is not None:
        spare = inputs.device_memory_bytes - buffers * inputs.whole_bytes - inputs.other_bytes
    elif inputs.device_headroom_bytes is not None:
        spare = inputs.device_headroom_bytes
    else:
        return math.inf
    spare -= buffers * inputs.interior_extra_bytes
    if inputs.other_bytes == 0:
        return math.inf if spare >= 0 else -math.inf
    return spare / (buffers * inputs.other_bytes)


def host_memory_shortfall(inputs: AlphaInputs) -> int:
    """Bytes M_host lacks for the arena even at alpha = 0 (0 if it fits)."""
    return max(0, inputs.host_bytes_needed(0.0) - int(inputs.host_memory_bytes))


def solve_alpha(inputs: AlphaInputs) -> AlphaDecision:
    """Solve the alpha LP in closed form: alpha = clip01(min(bandwidth bound, host bound)).

    The returned alpha satisfies ``inputs.fits_host(alpha)`` exactly (page rounding and the
    ceil of the slot bytes included) whenever alpha = 0 fits; floating-point rounding of the
    bound is corrected by stepping alpha down to the next representable float.
    """
    bandwidth_bound = _bound(inputs.bandwidth_bytes_per_s * inputs.layer_forward_s, inputs)
    host_bound = _host_bound(inputs)
    device_bound = _device_bound(inputs)
    alpha = min(1.0, max(0.0, min(bandwidth_bound, host_bound, device_bound)))
    # host_bound = integer / S_oth, so alpha*S_oth exceeds the integer by at most a few ulps.
    for _ in range(64):
        if alpha == 0.0 or inputs.fits_host(alpha):
            break
        alpha = math.nextafter(alpha, 0.0)
    else:  # unreachable unless the slot-cost model changes; never return an overflowing alpha
        alpha = 0.0
    shortfall = host_memory_shortfall(inputs)
    if alpha >= 1.0:
        limited_by = LIMITED_BY_NOTHING
    elif shortfall > 0 or host_bound <= min(bandwidth_bound, device_bound):
        limited_by = LIMITED_BY_HOST_MEMORY  # a host shortfall trumps the other bounds
    elif device_bound < bandwidth_bound:
        limited_by = LIMITED_BY_DEVICE_MEMORY
    else:
        limited_by = LIMITED_BY_BANDWIDTH
    return AlphaDecision(
        alpha=alpha,
        bandwidth_bound=bandwidth_bound,
        host_memory_bound=host_bound,
        limited_by=limited_by,
        host_bytes_needed=inputs.host_bytes_needed(alpha),
        host_bytes_missing_at_alpha0=shortfall,
        device_memory_bound=device_bound,
    )


def solve_alpha_lp(inputs: AlphaInputs) -> float:
    """The same LP without page rounding (``page_locked`` is ignored), solved by HiGHS.

    Uses ``pulp.HiGHS(msg=False)``, or CBC (``pulp.PULP_CBC_CMD``) when HiGHS is unavailable.
    Rows are scaled by S_in + S_attn + S_oth so the solver's tolerances are relative. Returns
    0.0 when the LP is infeasible (alpha = 0 already violates a constraint), which is the
    closed form's clipping convention. For cross-checking :func:`solve_alpha` in tests.
    """
    import pulp

    scale = float(max(1, inputs.whole_bytes + inputs.other_bytes))
    problem = pulp.LpProblem("memo_alpha", pulp.LpMaximize)
    alpha = pulp.LpVariable("alpha", lowBound=0.0, upBound=1.0)
    problem += alpha
    whole = inputs.whole_bytes / scale
    extra = inputs.interior_extra_bytes / scale
    other = inputs.other_bytes / scale
    buffers = inputs.rounding_buffers
    problem += (whole + extra + other * alpha
                <= inputs.bandwidth_bytes_per_s * inputs.layer_forward_s / scale), "bandwidth"
    if inputs.host_slots > 0:
        problem += (inputs.host_slots * (whole + extra + other * alpha)
                    <= inputs.host_memory_bytes / scale), "host_memory"
    if inputs.device_memory_bytes is not None:
        problem += (buffers * whole + other + buffers * (extra + other * alpha)
                    <= inputs.device_memory_bytes / scale), "device_memory"
    elif inputs.device_headroom_bytes is not None:
        problem += (buffers * (extra + other * alpha)
                    <= inputs.device_headroom_bytes / scale), "device_memory"
    solver = pulp.HiGHS(msg=False)
    if not solver.available():
        solver = pulp.PULP_CBC_CMD(msg=False)
    status = problem.solve(solver)
    if pulp.LpStatus[status] != "Optimal":
        return 0.0
    return float(min(1.0, max(0.0, alpha.value() or 0.0)))


def format_alpha_log(inputs: AlphaInputs, decision: AlphaDecision) -> str:
    """One log line: every LP input (GB, GB/s, ms), the chosen alpha and the binding constraint."""
    copy_ms_at_0 = inputs.whole_bytes / inputs.bandwidth_bytes_per_s * 1e3
    if decision.limited_by == LIMITED_BY_NOTHING:
        binding = "no constraint binds (all tokens offloaded)"
    elif decision.limited_by == LIMITED_BY_BANDWIDTH:
        binding = "limited by bandwidth"
        if decision.bandwidth_bound < 0:
            binding += (f" (even alpha=0 copies take {copy_ms_at_0:.2f} ms > layer forward; "
                        "copies will stall compute)")
    elif decision.limited_by == LIMITED_BY_DEVICE_MEMORY:
        binding = ("limited by device memory (--memo-device-memory-gb)"
                   if inputs.device_memory_bytes is not None else
                   "limited by device memory (headroom measured at alpha=0)")
    else:
        binding = "limited by host memory"
        if not decision.fits_host_memory:
            binding += (f" (even alpha=0 lacks {decision.host_bytes_missing_at_alpha0 / _GB:.3f} "
                        "GB: fall back to recomputation, do not offload)")
    return (
        f"MEMO alpha={decision.alpha:.4f} {binding} | bounds: bandwidth {decision.bandwidth_bound:.4g}, "
        f"host memory {decision.host_memory_bound:.4g}, device memory "
        f"{decision.device_memory_bound:.4g} | per layer per micro-batch: "
        f"S_in {inputs.input_bytes / _GB:.3f} GB, S_attn {inputs.attention_output_bytes / _GB:.3f} GB, "
        f"S_oth {inputs.other_bytes / _GB:.3f} GB | B {inputs.bandwidth_bytes_per_s / _GB:.2f} GB/s, "
        f"T_layer {inputs.layer_forward_s * 1e3:.2f} ms | host {inputs.host_memory_bytes / _GB:.3f} GB "
        f"for {inputs.offloaded_layers} layers x {inputs.microbatches_in_flight} micro-batches, "
        f"slots {'page-locked, whole pages' if inputs.page_locked else 'at their bytes'}, "
        f"needs {decision.host_bytes_needed / _GB:.3f} GB at alpha | device: {_device_text(inputs)}"
    )


def _device_text(inputs: AlphaInputs) -> str:
    if inputs.device_memory_bytes is not None:
        return f"budget {inputs.device_memory_bytes / _GB:.3f} GB (--memo-device-memory-gb)"
    if inputs.device_headroom_bytes is not None:
        return f"{inputs.device_headroom_bytes / _GB:.3f} GB free at the alpha=0 peak"
    return "capacity unknown, not constrained"
