"""One parallel layout of a job, predicted end to end (memory and time), and the search over
layouts the recommender runs. This package's entry point: import the public names from here.

A :class:`LayoutModel` traces each distinct pipeline stage of the layout at two sequence lengths
(memo-trace on fake tensors, cached on disk by :class:`TraceCache`; a deep stage symbolically,
memo_ext.estimate.symbolic), then answers at any length: the allocation trace through the
allocator model (memory.py: fit or OOM, reorganisations) and the work through the cost model
(cost.py: step time, MFU). The prediction is the worst stage's memory and the slowest stage's
time. Host memory is checked too: MEMO's offload slots of every rank of a node must fit the
node's host memory.

:func:`candidate_layouts` enumerates (TP, CP, PP, DP, policy, alpha, micro-batch) for a number
of GPUs and drops, before any tracing, what cannot run: shapes that do not divide, and layouts
whose parameters, gradients and optimizer state alone exceed the device (bytes per parameter:
memo_ext.estimate.rank_constants). :func:`build_models` traces candidates in parallel;
memo_ext.estimate.search ranks them.

One concern per module:

- ``spec``: what a layout is (:class:`Layout`, :class:`Stage`), which ranks are traced, its
  trace requests and its trainer flags;
- ``trace_cache``: traces on disk keyed by the trace request and the tracer's sources;
- ``candidates``: the layouts worth tracing for a number of GPUs;
- ``prediction``: a layout at one length (memory per stage, time, host memory, verdict);
- ``model``: :class:`LayoutModel`, a layout at any length, and building many in parallel.
"""

from memo_ext.estimate.layout.candidates import (
    MAX_HEAD_CHUNKS,
    block_recompute_layers,
    candidate_layouts,
    checkpoint_layer_counts,
)
from memo_ext.estimate.layout.model import (
    CHECK_SEQ,
    LayoutModel,
    Progress,
    StageModel,
    build_layout_model,
    build_models,
)
from memo_ext.estimate.layout.prediction import Prediction, StagePrediction
from memo_ext.estimate.layout.spec import (
    BLOCK_RECOMPUTE_FRACTIONS,
    CHECKPOINT_FRACTIONS,
    CPU_TRACE_FIELDS,
    FIT_SEQS,
    POLICY_FLAGS,
    POLICY_NAMES,
    REPLAY_ITERATIONS,
    SYMBOLIC_LAYERS,
    Layout,
    Stage,
    target_fields,
)
from memo_ext.estimate.layout.trace_cache import TraceCache, default_cache_dir

__all__ = [
    "BLOCK_RECOMPUTE_FRACTIONS", "CHECKPOINT_FRACTIONS", "CHECK_SEQ",
    "CPU_TRACE_FIELDS", "FIT_SEQS", "MAX_HEAD_CHUNKS",
    "POLICY_FLAGS", "POLICY_NAMES", "REPLAY_ITERATIONS", "SYMBOLIC_LAYERS", "Layout",
    "LayoutModel", "Prediction", "Progress", "Stage", "StageModel", "StagePrediction",
    "TraceCache", "block_recompute_layers", "build_layout_model", "build_models",
    "candidate_layouts", "checkpoint_layer_counts", "default_cache_dir", "target_fields",
]
