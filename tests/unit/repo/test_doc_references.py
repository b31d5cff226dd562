"""Every file a comment, docstring or doc page points to exists, and so does every cited heading.

Why: the code cites its design notes ("docs/memo.md "Bi-level memory planning"") and docs point
at scripts and results (``bench/results/x.md``). When a file moves or a note lives only outside
the repository, the pointer silently rots. This test reads every tracked text file and checks:

- repository paths (``docs/``, ``bench/``, ``tools/``, ``examples/``, ``csrc/``, ``memo_ext/``,
  ``tests/``, ``megatron/`` followed by a file name with an extension) resolve from the root;
- bare design-note names (``memo.md``, ``sppo.md``, ``metp.md``, ``ARCHITECTURE.md``) and
  ``specs/*.md`` resolve relative to the citing file (a clone has no shared notes);
- markdown links ``[text](target)`` resolve relative to the file that holds them;
- a cited heading, ``docs/X.md "Heading"``, begins some ``#`` heading of X.md.

Not checked, on purpose: URLs, ``../shared/...`` paths (data the code reads at runtime and
skips without), paths with ``{`` or ``*`` (templates and globs), and paths that only exist after
a tool writes them (``runs/``, ``data_cache/`` are outside the prefixes above).
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

from tests.conftest import REPO_ROOT

ROOT = REPO_ROOT

#: Which tracked files are read: source and text files that can hold a reference.
TEXT_SUFFIXES = {".py", ".md", ".cpp", ".h", ".sh", ".sbatch"}
TEXT_NAMES = {"Makefile"}

#: Directories at the repository root whose files the code and docs refer to.
PREFIXES = ("docs", "bench", "tools", "examples", "csrc", "memo_ext", "tests", "megatron")
EXTENSIONS = ("md", "py", "cpp", "h", "cu", "sh", "sbatch", "json", "txt", "toml", "png")

# Each pattern starts with a literal so that a 3 MB scan stays well under a second; what must
# not come right before a match (a longer path, a URL) is checked in _starts_a_token.

#: A repository path: one of PREFIXES, a slash, and a file name with one of EXTENSIONS. Not
#: followed by ``*`` or ``{`` (a glob or a template).
REPO_PATH = re.compile(
    r"(?:%s)/[\w./-]*?\w\.(?:%s)(?![\w/*{-])" % ("|".join(PREFIXES), "|".join(EXTENSIONS)))

#: A bare design-note name used as a citation. Quoted on both sides it is a file name in code
#: (``out / "sppo.md"``), not a citation: see :func:`_is_quoted_name`.
NOTE_NAME = re.compile(r"(?:memo|sppo|metp|ARCHITECTURE)\.md(?![\w-])")

#: The shared notes outside the repository (``shared/specs/x.md``): a clone has none of them.
SHARED_NOTE = re.compile(r"specs/[\w-]+\.md")

#: ``[text](target)`` in markdown.
MD_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")

#: `` "Heading"`` right after a ``.md`` name (``PATH.md "Heading"`` or ``PATH.md, "Heading"``);
#: the heading may wrap onto the next line. The path before it is read by _path_before.
HEADING_CITE = re.compile(r"\.md,? \"([^\"]{1,120})\"")


def _starts_a_token(text: str, start: int) -> bool:
    """No path character or URL colon right before ``start``."""
    return start == 0 or not (text[start - 1].isalnum() or text[start - 1] in "_./:-")


def repo_paths(text: str):
    """(offset, path) of every repository path in ``text``."""
    for m in REPO_PATH.finditer(text):
        if _starts_a_token(text, m.start()):
            yield m.start(), m.group()


def note_names(text: str):
    """(offset, name) of every bare design-note name cited in ``text``."""
    for m in NOTE_NAME.finditer(text):
        if _starts_a_token(text, m.start()) and not _is_quoted_name(text, m.start(), m.end()):
            yield m.start(), m.group()


def heading_citations(text: str):
    """(offset, path, heading) of every ``PATH.md "Heading"`` in ``text``."""
    for m in HEADING_CITE.finditer(text):
        path = re.search(r"[\w./-]*\w$", text[max(0, m.start() - 200):m.start()])
        if path:
            yield m.start(1), path.group() + ".md", m.group(1)


#: Paths named on purpose although they do not exist.
ABSENT_ON_PURPOSE = {
    "megatron/__init__.py",  # README and docs say there is none (namespace package)
    # Megatron-LM's launch scripts (megatron/training/upstream_scripts.py): upstream's paths.
    "examples/gpt3/train_gpt3_175b_distributed.sh",
    "examples/llama/train_llama3_8b_h100_fp8.sh",
    "examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh",
}

#: (file, path prefix) pairs where the path is test data, not a reference, and why.
NOT_REFERENCES = {
    ("tests/unit/memo_ext/estimate/test_trace_key.py", "memo_ext/"):
        "a fake package written under tmp_path",
    # Each recorded run lists the files that were uncommitted when it ran: history, not a
    # pointer into today's tree.
    ("examples/configs/recommended.md", "memo_ext/"): "provenance of recorded runs",
    # The same provenance from before tests/unit mirrored the source tree (flat test files).
    ("examples/configs/recommended.md", "tests/unit/test_"): "provenance of recorded runs",
}


def _tracked_text_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True)
    names = [n for n in out.stdout.decode().split("\0") if n]
    this = Path(__file__).resolve().relative_to(ROOT).as_posix()  # its examples are not references
    return [n for n in names
            if (Path(n).suffix in TEXT_SUFFIXES or Path(n).name in TEXT_NAMES)
            and n != this and (ROOT / n).is_file()]


def _norm(text: str) -> str:
    """Heading text for comparison: no comment markers, backticks, case or extra spaces."""
    text = re.sub(r"\n\s*(?:#:?|//|\*)?\s*", " ", text)
    return " ".join(text.replace("`", "").lower().split())


@functools.lru_cache(maxsize=None)
def _headings(path: Path) -> list[str]:
    return [_norm(m.group(1)) for m in re.finditer(r"^#+\s+(.+)$", path.read_text(), re.M)]


def _resolve(target: str, source: str) -> Path | None:
    """The file ``target`` names, from the repository root or from ``source``'s folder."""
    for base in (ROOT, (ROOT / source).parent):
        candidate = (base / target).resolve()
        if candidate.is_file() and ROOT in candidate.parents:
            return candidate
    return None


def _is_quoted_name(text: str, start: int, end: int) -> bool:
    """True for ``"sppo.md"``: the same quote right before and right after."""
    return 0 < start and end < len(text) and text[start - 1] in "'\"" and text[end] == text[start - 1]


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def find_broken_references(files: list[str]) -> list[str]:
    """``file:line: what`` for every reference in ``files`` that does not resolve."""
    problems = []
    for name in files:
        text = (ROOT / name).read_text(errors="replace")
        found: list[tuple[int, str]] = []
        for offset, path in repo_paths(text):
            if path not in ABSENT_ON_PURPOSE and not any(
                    name == f and path.startswith(prefix) for f, prefix in NOT_REFERENCES):
                found.append((offset, path))
        found.extend(note_names(text))
        for m in SHARED_NOTE.finditer(text):
            problems.append(f"{name}:{_line(text, m.start())}: {m.group()} is in the shared notes, "
                            "not in the repository; cite the docs/ page that carries it")
        if name.endswith(".md"):
            for m in MD_LINK.finditer(text):
                target = m.group(1).split("#", 1)[0]
                if target and not re.match(r"[a-z]+:", target) and "{" not in target:
                    found.append((m.start(1), target))
        for offset, target in found:
            if _resolve(target, name) is None:
                problems.append(f"{name}:{_line(text, offset)}: {target} does not exist")
        for offset, path, heading in heading_citations(text):
            target = _resolve(path, name)
            if target is None:
                continue  # a missing file is reported above
            if not any(h.startswith(_norm(heading)) for h in _headings(target)):
                problems.append(f"{name}:{_line(text, offset)}: no heading \"{heading}\" in "
                                f"{target.relative_to(ROOT)}")
    return problems


def test_references_resolve():
    problems = find_broken_references(_tracked_text_files())
    assert not problems, ("references to files or headings that do not exist:\n"
                          + "\n".join(problems))


def test_patterns_catch_what_they_should():
    """The patterns on a few hand-written lines, so a loosened regex shows up here."""
    assert [p for _, p in repo_paths("see docs/memo.md's table and bench/results/sppo.md.")] == [
        "docs/memo.md", "bench/results/sppo.md"]
    assert list(repo_paths("https://x.org/docs/a.md ../shared/tools/x.py tests/unit/t*.py "
                           "examples/configs/gpt_{7b,13b}.sh")) == []
    line = '(memo.md, "Choosing") out / "sppo.md" docs/metp.md """metp.md\'s r'
    assert [n for _, n in note_names(line)] == ["memo.md", "metp.md"]
    assert [(p, h) for _, p, h in heading_citations('x docs/memo.md "Bi-level\n#: memory planning"')] == [
        ("docs/memo.md", "Bi-level\n#: memory planning")]
    assert _norm("Bi-level\n#: memory planning") == "bi-level memory planning"
    assert SHARED_NOTE.findall("our notes in `shared/specs/sppo.md`") == ["specs/sppo.md"]
