"""Weights & Biases logging with Megatron-LM's flags (``--wandb-project``, ``--wandb-exp-name``,
``--wandb-save-dir``, ``--wandb-entity``).

``wandb`` is an optional dependency (``pip install megatron-memo[wandb]``): without
--wandb-project nothing imports it; with it and no wandb installed the run is refused in one
line. As in Megatron-LM, only the last rank (which holds the loss) opens a run, in
--wandb-save-dir (default --save/wandb), with the parsed arguments as its config; every record
the trainer writes to TensorBoard (loss, lr, grad norm, throughput, memory, validation loss)
goes to it too. ``WANDB_MODE=offline`` (wandb's own switch) keeps everything local.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Optional

WANDB_FLAGS = ("--wandb-exp-name", "--wandb-save-dir", "--wandb-entity")


def add_wandb_args(group) -> None:
    group.add_argument("--wandb-project", default=None,
                       help="Log to this Weights & Biases project (the optional 'wandb' extra).")
    group.add_argument("--wandb-exp-name", default=None, help="The W&B run's name.")
    group.add_argument("--wandb-save-dir", default=None,
                       help="W&B's local directory (default: --save/wandb).")
    group.add_argument("--wandb-entity", default=None, help="The W&B entity (team or user).")


def wandb_problem(args: argparse.Namespace) -> Optional[str]:
    """Why the W&B flags cannot run (one line naming the flag), or None."""
    if not args.wandb_project:
        for flag in WANDB_FLAGS:
            if getattr(args, flag[2:].replace("-", "_")) is not None:
                return f"{flag} has no effect without --wandb-project; add it or drop the flag"
        return None
    if importlib.util.find_spec("wandb") is None:
        return ("--wandb-project needs the wandb package, which is not installed: pip install "
                "'megatron-memo[wandb]' (or pip install wandb), or drop the --wandb-* flags")
    if args.wandb_save_dir is None and args.save is None:
        return ("--wandb-project writes into --wandb-save-dir, by default --save/wandb; give "
                "one of them")
    return None


def open_wandb_run(args: argparse.Namespace, is_writer: bool):
    """The W&B run of this rank (the writer with --wandb-project), or None."""
    if not (args.wandb_project and is_writer):
        return None
    import wandb

    directory = args.wandb_save_dir or os.path.join(args.save, "wandb")
    os.makedirs(directory, exist_ok=True)
    config = {key: value for key, value in vars(args).items()
              if isinstance(value, (int, float, str, bool, list, tuple, type(None)))}
    return wandb.init(dir=directory, name=args.wandb_exp_name, project=args.wandb_project,
                      entity=args.wandb_entity, config=config)
