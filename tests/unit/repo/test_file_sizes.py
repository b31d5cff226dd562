"""Files in memo_ext/ and csrc/ stay short enough to read in one sitting (docs/architecture.md,
"Invariants"): a file over the limit must say at its top why it is one file."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import REPO_ROOT

REPO = REPO_ROOT
MAX_LINES = 600
#: The marker a long file's header carries, followed by its reason.
REASON_MARKER = "Why one file:"
HEADER_LINES = 30


def _tracked_sources() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "memo_ext", "csrc"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.split()
    return [REPO / name for name in listed
            if name.endswith((".py", ".cpp", ".h", ".cu")) and (REPO / name).is_file()]


def test_long_files_give_their_reason():
    sources = _tracked_sources()
    assert sources, "git ls-files found no sources (not a git checkout?)"
    unexplained = []
    for path in sources:
        lines = path.read_text(encoding="utf-8").splitlines()
        if len(lines) > MAX_LINES and not any(REASON_MARKER in line
                                              for line in lines[:HEADER_LINES]):
            unexplained.append(f"{path.relative_to(REPO)}: {len(lines)} lines")
    assert not unexplained, (
        f"over {MAX_LINES} lines without '{REASON_MARKER} ...' in the first {HEADER_LINES} "
        f"lines; split the file by concern or write the reason: {unexplained}")
