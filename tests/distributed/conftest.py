"""Runs shared across this folder's modules (session-scoped: each runs once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY_GPT_ARGS, read_losses, run_trainer

DISTRIBUTED = ["--use-distributed-optimizer"]
SAVE_INTERVAL = 5


@pytest.fixture(scope="session")
def dp2_distributed(tmp_path_factory) -> tuple[dict[int, float], Path]:
    """The DP=2 distributed-optimizer run of the tiny model: its losses and its torch_dist
    checkpoints (every 5 iterations), which the resume tests copy from and never change."""
    root = tmp_path_factory.mktemp("distributed_dp2")
    checkpoints, metrics = root / "checkpoints", root / "metrics.jsonl"
    run_trainer(2, TINY_GPT_ARGS + DISTRIBUTED + [
        "--save", str(checkpoints), "--save-interval", str(SAVE_INTERVAL),
        "--log-metrics-jsonl", str(metrics)])
    return read_losses(metrics), checkpoints
