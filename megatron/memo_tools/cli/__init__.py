"""The command-line tools, importable so that an installed (non-editable) package has them: each
module's ``main(argv)`` is a console script of pyproject.toml (memo-estimate, memo-trace,
memo-plan, memo-memory-report, memo-sppo-plan), and ``tools/<name>.py`` in the repository calls
the same ``main``."""
