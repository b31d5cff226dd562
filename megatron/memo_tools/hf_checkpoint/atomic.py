"""Write a directory all at once: into a hidden sibling, renamed into place when complete, so
that a crash or an error never leaves a half-written output under the final name."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from megatron.memo_tools.hf_checkpoint.errors import ConversionError


def check_output_directory(path: Path, flag: str) -> None:
    """Refuse an output that exists and is not an empty directory."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConversionError(f"{flag} {path} exists and is not empty; pick a new directory "
                              "or delete it")


@contextlib.contextmanager
def atomic_directory(path: Path, flag: str) -> Iterator[Path]:
    """Yield a temporary directory beside ``path``; rename it to ``path`` when the block ends
    without an error, delete it otherwise."""
    path = Path(path).absolute()
    check_output_directory(path, flag)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.partial-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        yield temporary
        if path.exists():
            path.rmdir()  # empty, checked above
        os.replace(temporary, path)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
