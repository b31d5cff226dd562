"""SPPO's pipeline schedule: subsequences flow through the pipeline stages as micro-batches.

For each sequence (micro-batch of the global batch) every stage runs forward on subsequences
0..N-1 in order -- receiving each one's hidden states from the previous stage and sending its
output on -- then backward on N-1..0, receiving output gradients from the next stage and sending
input gradients back. Backward must run in reverse subsequence order (a subsequence's dK/dV
collects contributions from every later one), so a stage cannot start backward before its last
forward: the schedule is fill-drain per sequence, and with equal-work (FLOPs-balanced)
subsequences its bubble ratio is (p-1)/N (docs/sppo.md "Pipeline and solver").

megatron.core's 1F1B schedules run backward in forward order and assume one tensor shape for
every micro-batch; FLOPs-balanced subsequences have different lengths. Hence this schedule; it
keeps megatron's conventions (set_input_tensor, the loss function's (sum, tokens, report) triple
divided by the sequence's tokens and the micro-batch count, grad_scale_func,
no_sync_func and finalize_model_grads_func from the TransformerConfig).

Point-to-point traffic uses torch.distributed isend/irecv on the pipeline group: every stage
knows every subsequence's shape from the partition, and the order (blocking receives, asynchronous
sends, no cycles) cannot deadlock.

With --memo-sppo-msp every stage runs :func:`memo_ext.sppo.msp_plan.stage_program`: its own
steps and its share of other stages' multiplexed tasks, all in the order of the fill-drain
slots. Dependencies only point to earlier slots and a multiplexed task's members all reach it
in the same slot, so that order cannot deadlock either (tests/unit/memo_ext/sppo/test_sppo_msp.py plays it).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model

from memo_ext.sppo.msp_plan import BACKWARD, FORWARD, HELP_BACKWARD, stage_program


class SubsequenceBatches:
    """The iterator a forward step reads while subsequence ``i`` of the current sequence runs:
    each ``next()`` returns the current sequence's batch with every [b, s] tensor cut to the
    subsequence's tokens, except those under ``whole_keys`` (the packed documents' offsets of
    the whole sequence, which the attention maps itself; a [1, k] tensor of offsets could
    have k == s). The underlying iterator advances once per sequence, when subsequence 0
    first asks."""

    def __init__(self, sequences: Iterator, boundaries: list[int],
                 whole_keys: Collection[str] = ()):
        self.sequences = sequences
        self.boundaries = boundaries
        self.whole_keys = frozenset(whole_keys)
        self.seq_length = boundaries[-1]
        self.index = 0
        self.sequence: Optional[dict] = None

    def start(self, index: int) -> None:
        if index == 0:
            self.sequence = None
        self.index = index

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.sequence is None:
            self.sequence = next(self.sequences)
        begin, end = self.boundaries[self.index], self.boundaries[self.index + 1]
        return {key: value if key in self.whole_keys else self._cut(value, begin, end)
                for key, value in self.sequence.items()}

    def sequence_tokens(self) -> Optional[torch.Tensor]:
        """Loss tokens of the whole current sequence (None where this stage read no data)."""
        if self.sequence is None or "loss_mask" not in self.sequence:
            return None
        return self.sequence["loss_mask"].sum()

    def _cut(self, value, begin: int, end: int):
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.size(1) == self.seq_length:
            return value[:, begin:end].contiguous()
        return value


@dataclass
class StageTimeline:
    """Busy intervals of this stage in the last schedule run (seconds since its start): the
    bubble is the idle share of the wall time."""

    busy: list = field(default_factory=list)
    wall_seconds: float = 0.0

    def bubble_ratio(self) -> float:
        """Idle time / busy time, the definition behind docs/sppo.md's (p-1)/N."""
        busy = sum(end - begin for begin, end in self.busy)
        return (self.wall_seconds - busy) / busy if busy else 0.0


class _Clock:
    def __init__(self, timeline: StageTimeline):
        timeline.busy, timeline.wall_seconds = [], 0.0
        self.timeline = timeline
        self.origin = time.perf_counter()

    @contextlib.contextmanager
    def busy(self):
        begin = time.perf_counter() - self.origin
        yield
        self.timeline.busy.append((begin, time.perf_counter() - self.origin))

    def stop(self) -> None:
        self.timeline.wall_seconds = time.perf_counter() - self.origin


def run_subsequence_pipeline(*, forward_step_func: Callable, data_iterator, model: list,
                             num_microbatches: int, micro_batch_size: int, hidden_size: int,
                             forward_only: bool, subsequences, config,
                             offloader=None, timeline: Optional[StageTimeline] = None,
                             multiplexer=None, whole_keys: Collection[str] = ()) -> list:
    """One global batch: ``num_microbatches`` sequences, each as the subsequences of
    ``subsequences.boundaries``. Returns the loss reports of the last stage (one per
    subsequence), like megatron.core's schedules. With ``multiplexer`` (--memo-sppo-msp) the
    stage also runs its share of other stages' multiplexed tasks, in slot order. Batch entries
    under ``whole_keys`` reach every subsequence whole (:class:`SubsequenceBatches`)."""
    if len(model) != 1:
        raise ValueError("--memo-sppo does not support virtual pipeline stages")
    chunk = model[0]
    boundaries = subsequences.boundaries
    count = len(boundaries) - 1
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    group = parallel_state.get_pipeline_model_parallel_group()
    sequence_split = (parallel_state.get_tensor_model_parallel_world_size()
                      if config.sequence_parallel else 1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    set_input_tensor = get_attr_wrapped_model(chunk, "set_input_tensor")
    program = stage_program(parallel_state.get_pipeline_model_parallel_rank(),
                            parallel_state.get_pipeline_model_parallel_world_size(), count,
                            multiplexer.tasks if multiplexer is not None else {}, forward_only)
    if multiplexer is not None:
        multiplexer.training = not forward_only

    def hidden_shape(index: int) -> tuple:
        tokens = boundaries[index + 1] - boundaries[index]
        return (tokens // sequence_split, micro_batch_size, hidden_size)

    def receive(index: int, source: int, requires_grad: bool) -> torch.Tensor:
        tensor = torch.empty(hidden_shape(index), dtype=config.pipeline_dtype, device=device)
        dist.recv(tensor, src=source, group=group)
        return tensor.requires_grad_(requires_grad)

    pending_sends: list = []

    def send(tensor: torch.Tensor, destination: int) -> None:
        tensor = tensor.detach().contiguous()
        pending_sends[:] = [(work, kept) for work, kept in pending_sends if not work.is_completed()]
        pending_sends.append((dist.isend(tensor, dst=destination, group=group), tensor))

    clock = _Clock(timeline if timeline is not None else StageTimeline())
    batches = SubsequenceBatches(data_iterator, boundaries, whole_keys)
    reports: list = []
    no_sync = config.no_sync_func if (config.no_sync_func is not None and not forward_only) \
        else None
    for microbatch in range(num_microbatches):
        inputs, outputs = [None] * count, [None] * count

        def forward(index: int) -> None:
            batches.start(index)
            subsequences.enter(index)
            input_tensor = None if first else receive(
                index, parallel_state.get_pipeline_model_parallel_prev_rank(), not forward_only)
            with clock.busy(), (offloader.forward(index, count) if offloader and not forward_only
                                else contextlib.nullcontext()):
                set_input_tensor(input_tensor)
                output_tensor, loss_func = forward_step_func(batches, chunk)
                if last:
                    loss_sum, _, report = loss_func(output_tensor)
                    tokens = batches.sequence_tokens()
                    output_tensor = loss_sum / torch.clamp(tokens, min=1) / num_microbatches
                    reports.append(report)
            if not last:
                send(output_tensor, parallel_state.get_pipeline_model_parallel_next_rank())
            inputs[index] = input_tensor
            outputs[index] = None if forward_only else output_tensor

        def backward(index: int) -> None:
            subsequences.enter(index)
            output_grad = None if last else receive(
                index, parallel_state.get_pipeline_model_parallel_next_rank(), False)
            final_backward = microbatch == num_microbatches - 1 and index == 0
            with clock.busy(), (no_sync() if no_sync and not final_backward
                                else contextlib.nullcontext()):
                if offloader is not None and index > 0:  # overlaps this backward
                    offloader.prefetch(index - 1)
                output = outputs[index]
                if last and config.grad_scale_func is not None:
                    output = config.grad_scale_func(output)
                if inputs[index] is not None:
                    inputs[index].retain_grad()
                torch.autograd.backward(output, grad_tensors=output_grad)
                if offloader is not None:
                    offloader.release(index)
            if not first:
                send(inputs[index].grad, parallel_state.get_pipeline_model_parallel_prev_rank())
            inputs[index] = outputs[index] = None

        for kind, step in program:
            if kind == FORWARD:
                forward(step)
            elif kind == BACKWARD:
                backward(step)
            else:
                with clock.busy():
                    multiplexer.help(step, backward=kind == HELP_BACKWARD)
        subsequences.end_sequence()
    for work, _ in pending_sends:
        work.wait()
    clock.stop()
    if not forward_only and config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func(model, None)
    return reports
