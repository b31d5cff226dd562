"""Datasets and iterators: megatron.core GPTDataset (indexed .bin/.idx) or MockGPTDataset,
read in Megatron's sample order from a resumable position."""

from __future__ import annotations

import argparse
from typing import Iterator, Optional

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import get_blend_from_list

from megatron.training.arguments import ArgumentValidationError, data_path_prefixes
from megatron.training.packed_documents import DocumentOffsets

SPLIT_NAMES = ("train", "validation", "test")


def dataset_sample_counts(args: argparse.Namespace) -> list[int]:
    """Samples needed from the train, validation and test splits over the whole run (the
    trainer never evaluates on the test split, so none are drawn from it)."""
    train = args.train_iters * args.global_batch_size
    evaluations = args.train_iters // args.eval_interval + 1
    valid = evaluations * args.eval_iters * args.global_batch_size
    return [train, valid, 0]


def check_splits_have_documents(args: argparse.Namespace, samples: list[int]) -> None:
    """Refuse a --split that leaves a split of a dataset that ``samples`` draws from without
    documents.

    megatron.core's GPTDataset loops forever when asked for samples from a split with no
    tokens. The split is cut at round(cumulative weight * documents), as the builder does.
    """
    weights = parse_and_normalize_split(args.split)
    for prefix in data_path_prefixes(args.data_path):
        documents = IndexedDataset(prefix).sequence_lengths.shape[0]
        bounds = [int(round(sum(weights[:i]) * documents)) for i in range(len(weights) + 1)]
        for name, weight, first, last, needed in zip(SPLIT_NAMES, weights, bounds, bounds[1:], samples):
            if weight > 0 and needed > 0 and last == first:
                raise ArgumentValidationError(
                    f"--split {args.split} gives the {name} split of --data-path {prefix} no "
                    f"documents (it has {documents}); raise that weight or set it to 0"
                )


def build_datasets(args: argparse.Namespace, tokenizer,
                   samples: Optional[list[int]] = None) -> list[Optional[torch.utils.data.Dataset]]:
    """Build [train, valid, test] datasets on every rank (rank 0 first, which fills the cache)
    of ``samples`` samples each (default: what the run reads, :func:`dataset_sample_counts`)."""
    if samples is None:
        samples = dataset_sample_counts(args)
    if not args.mock_data:
        check_splits_have_documents(args, samples)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if args.mock_data else get_blend_from_list(args.data_path),
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,
        mmap_bin_files=getattr(args, "mmap_bin_files", True),  # --no-mmap-bin-files
    )
    # A split the run draws nothing from is not built: megatron-core's GPTDataset, asked for 0
    # samples of a split without documents (a small corpus, a test weight of 1 in 1000), loops
    # forever. The other splits keep their bookends.
    config.split_matrix = [None if count == 0 else bookends
                           for count, bookends in zip(samples, config.split_matrix)]
    dataset_class = MockGPTDataset if args.mock_data else GPTDataset
    datasets = BlendedMegatronDatasetBuilder(
        dataset_class, samples, lambda: True, config
    ).build()
    if args.reset_attention_mask:  # per-document offsets, not megatron's [s, s] mask
        datasets = [None if ds is None else DocumentOffsets(ds, tokenizer.eod) for ds in datasets]
    return datasets


class MicroBatchSampler(torch.utils.data.Sampler):
    """Sample indices of this data-parallel rank's micro-batches, starting after
    ``consumed_samples`` so a resumed run reads exactly what the uninterrupted run would.

    A global batch step of ``micro_batch_size * dp_size`` samples is laid out rank-major: rank
    r reads samples [step_start + r*mbs, step_start + (r+1)*mbs).
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int):
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.step = micro_batch_size * dp_size

    def __iter__(self) -> Iterator[list[int]]:
        start = self.consumed_samples
        while start + self.step <= self.total_samples:
            first = start + self.dp_rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))
            start += self.step

    def __len__(self) -> int:
        return max(0, (self.total_samples - self.consumed_samples) // self.step)


def _cycle(loader: torch.utils.data.DataLoader) -> Iterator[dict]:
    while True:
        yield from loader


def build_data_iterator(dataset, consumed_samples: int, args: argparse.Namespace,
                        cyclic: bool = False) -> Optional[Iterator[dict]]:
    """A micro-batch iterator over ``dataset`` for this rank, or None if there is no dataset."""
    if dataset is None or len(dataset) == 0:
        return None
    sampler = MicroBatchSampler(
        total_samples=len(dataset),
        consumed_samples=consumed_samples % len(dataset) if cyclic else consumed_samples,
        micro_batch_size=args.micro_batch_size,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
    )
    # A private generator: creating a loader iterator draws a worker seed, and drawing it from
    # the global generator would shift dropout masks between a resumed and an uninterrupted run.
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=args.num_workers,
        pin_memory=False,
        generator=torch.Generator().manual_seed(args.seed),
    )
    return _cycle(loader) if cyclic else iter(loader)
