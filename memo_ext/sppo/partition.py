"""Where a sequence is cut into SPPO's subsequences (docs/sppo.md "Subsequences and causal attention").

Under causal attention a token late in the sequence attends to more keys than an early one, so
equal-length subsequences do unequal work and the pipeline's stages wait for the slowest. The
partition here equalises the per-layer FLOPs instead: the work of token range ``[a, b)`` is

    c_lin * (b - a) + c_attn * (b - a) * (a + b) / 2

(``c_lin`` the per-token FLOPs of the linear layers, ``c_attn`` the attention FLOPs per token
per key), i.e. the cumulative work up to token ``x`` is ``W(x) = c_lin*x + c_attn*x^2/2``, and
boundary ``k`` solves ``W(x_k) = k/N * W(S)``. Boundaries are rounded to multiples of
``multiple_of`` (the tensor-parallel size under sequence parallelism, so every rank gets an equal
share of every subsequence), which makes subsequences shorter towards the end of the sequence.
"""

from __future__ import annotations

from memo_ext.layer_flops import LayerFlops

PARTITION_FLOPS = "flops"
PARTITION_LENGTH = "length"
PARTITIONS = (PARTITION_FLOPS, PARTITION_LENGTH)


def length_boundaries(seq_length: int, subsequences: int, multiple_of: int = 1) -> list[int]:
    """``subsequences + 1`` token offsets cutting ``seq_length`` into near-equal lengths."""
    _check(seq_length, subsequences, multiple_of)
    units = seq_length // multiple_of
    return [multiple_of * (units * k // subsequences) for k in range(subsequences + 1)]


def flops_boundaries(seq_length: int, subsequences: int, flops: LayerFlops,
                     multiple_of: int = 1) -> list[int]:
    """``subsequences + 1`` token offsets giving every subsequence the same causal FLOPs (to
    the rounding to ``multiple_of``); every subsequence keeps at least ``multiple_of`` tokens."""
    _check(seq_length, subsequences, multiple_of)
    total = flops.of_range(0, seq_length)
    boundaries = [0]
    for k in range(1, subsequences):
        x = flops.token_at(total * k / subsequences)
        rounded = multiple_of * round(x / multiple_of)
        lowest = boundaries[-1] + multiple_of
        highest = seq_length - multiple_of * (subsequences - k)
        boundaries.append(min(max(rounded, lowest), highest))
    boundaries.append(seq_length)
    return boundaries


def partition(seq_length: int, subsequences: int, how: str, flops: LayerFlops,
              multiple_of: int = 1) -> list[int]:
    """Boundaries by ``how`` (``flops`` or ``length``); see the module docstring."""
    if how == PARTITION_FLOPS:
        return flops_boundaries(seq_length, subsequences, flops, multiple_of)
    if how == PARTITION_LENGTH:
        return length_boundaries(seq_length, subsequences, multiple_of)
    raise ValueError(f"partition {how!r} is not one of {', '.join(PARTITIONS)}")


def _check(seq_length: int, subsequences: int, multiple_of: int) -> None:
    if subsequences < 1 or multiple_of < 1:
        raise ValueError(f"need >= 1 subsequence and multiple_of >= 1, got {subsequences}, "
                         f"{multiple_of}")
    if seq_length % multiple_of or seq_length // multiple_of < subsequences:
        raise ValueError(f"a sequence of {seq_length} tokens cannot be cut into {subsequences} "
                         f"subsequences of whole multiples of {multiple_of} tokens")


#: Shortest subsequence ``auto`` makes, tokens: below ~2K tokens per subsequence the GEMMs of
#: one layer are too small to keep a GPU busy and per-subsequence launch costs dominate (the SPPO
#: paper finds 2K-16K tokens per subsequence best).
MIN_AUTO_SUBSEQUENCE_TOKENS = 2048

#: Bubble ratio (p-1)/N that ``auto`` aims at.
AUTO_BUBBLE_RATIO = 0.1


def auto_subsequences(seq_length: int, pipeline_size: int, multiple_of: int = 1) -> int:
    """The smallest power of two N with (p-1)/N <= AUTO_BUBBLE_RATIO, reduced while
    subsequences would be shorter than MIN_AUTO_SUBSEQUENCE_TOKENS (at least 1)."""
    count = 1
    while (pipeline_size - 1) / count > AUTO_BUBBLE_RATIO:
        count *= 2
    while count > 1 and (seq_length / count < MIN_AUTO_SUBSEQUENCE_TOKENS
                         or seq_length // multiple_of < count):
        count //= 2
    return count
