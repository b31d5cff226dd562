"""The estimator's prediction for a planned run: the same model, layout, policy, allocator and
sequence length through memo_ext.estimate's Python API (tools/estimate.py's code path).

Compared quantities: the allocator's peak of allocated bytes per rank (MemoryEstimate.
peak_allocated_bytes, the counterpart of the trainer's ``mem_peak_allocated_mib``; the memory
outside the allocator, CUDA context and NCCL, is in neither) and the iteration time of
``global_batch`` sequences from the cost model. SPPO is predicted by its analytic solver
(memo_ext.sppo.solver) at the run's subsequence count, its allocated peak being the solver's
total less its constant for memory outside the allocator. Everything here is predicted, not
measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.memo_tools.gpu_check.plan import SPPO_SUBSEQUENCES, PlannedRun

MIB = 1 << 20


class NoPrediction(Exception):
    """No prediction can be made for a run; the message is the one-line reason."""


@dataclass
class Predicted:
    """Predicted peak allocated memory per rank (MiB) and iteration time (s), and what the
    prediction assumed (allocator model, alpha)."""

    peak_mib: float
    iteration_s: float
    basis: str


def hardware_profile_name(device_name: str, total_memory_bytes: int) -> Optional[str]:
    """The memo_ext/hardware.json profile of a GPU (torch.cuda.get_device_name and its
    total memory in bytes), None when none matches."""
    name = device_name.lower()
    for key in ("h200", "h100", "a800"):
        if key in name:
            return key
    if "a100" in name:
        return "a100-80gb" if total_memory_bytes > 60e9 else "a100-40gb"
    return None


def model_shape(run: PlannedRun) -> dict:
    """The run's model as the estimator's shape dict (memo_ext.estimate.models)."""
    m = run.model
    return {"num_layers": m.num_layers, "hidden_size": m.hidden_size,
            "ffn_hidden_size": m.ffn_hidden_size, "num_attention_heads": m.num_attention_heads,
            "vocab_size": m.vocab_size}


def predict(run: PlannedRun, hardware: dict, cache, memo_alpha: Optional[float]) -> Predicted:
    """The estimator's figures for ``run`` on the GPU profile ``hardware`` (load_hardware),
    tracing through ``cache`` (memo_ext.estimate.layout.TraceCache); ``memo_alpha``: the alpha
    the MEMO run solved. Raises NoPrediction with the reason when there is none."""
    from memo_ext.estimate import EstimateError
    from memo_ext.estimate.cost import CostModelError
    from memo_ext.hardware import HardwareProfileError

    if run.mechanism.estimator is None:
        raise NoPrediction("no prediction for this mechanism (the estimator has no policy for "
                           "it)")
    policy, allocator = run.mechanism.estimator
    try:
        if policy == "sppo":
            return _predict_sppo(run, hardware)
        return _predict_traced(run, hardware, cache, policy, allocator, memo_alpha)
    except (EstimateError, HardwareProfileError, CostModelError) as error:
        raise NoPrediction(f"no prediction: {error}") from None


def _predict_traced(run: PlannedRun, hardware: dict, cache, policy: str, allocator: str,
                    memo_alpha: Optional[float]) -> Predicted:
    from memo_ext.estimate.layout import Layout, LayoutModel
    from memo_ext.estimate.models import traced_model

    basis = f"{allocator} allocator model"
    if policy == "memo":
        if memo_alpha is None:
            raise NoPrediction("no prediction: the run logged no solved alpha to predict at")
        basis += f", alpha {memo_alpha:g} (the run's)"
    shape = model_shape(run)
    traced = traced_model(None, {key: shape[key] for key in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size")})
    flags = run.mechanism.flags
    buffers = (int(flags[flags.index("--memo-offload-buffers") + 1])
               if "--memo-offload-buffers" in flags else 2)
    layout = Layout(run.tp, run.cp, run.pp, run.dp, policy, memo_alpha if policy == "memo" else None,
                    offload_buffers=buffers)
    # Traced at the run's own length (and twice it): a check's short runs sit below the
    # estimator's fitted lengths, where the chunked loss's capped logits buffer breaks the line.
    seq = run.model.seq_length
    model = LayoutModel.build(traced, layout, hardware, global_batch=run.global_batch,
                              cache=cache, allocator=allocator, fit_seqs=(seq, 2 * seq))
    prediction = model.predict(run.model.seq_length)
    return Predicted(prediction.memory.peak_allocated_bytes / MIB, prediction.step_s, basis)


def _predict_sppo(run: PlannedRun, hardware: dict) -> Predicted:
    from memo_ext.sppo.solver import Problem, SolverError, evaluate

    problem = Problem(model_shape(run), run.nproc, hardware, run.model.seq_length,
                      distributed_optimizer=True)
    try:
        candidate = evaluate(problem, run.tp, run.pp, SPPO_SUBSEQUENCES)
    except SolverError as error:
        raise NoPrediction(f"no prediction: {error}") from None
    memory = candidate.memory
    return Predicted((memory.total - memory.reserved) / MIB,
                     candidate.step_s * run.global_batch / candidate.dp,
                     f"SPPO analytic solver, N={SPPO_SUBSEQUENCES}")
