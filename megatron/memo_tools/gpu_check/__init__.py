"""``make gpu-check``: the GPU tests, then a 10-iteration training of each mechanism on the GPUs
present, with the measured peak memory and iteration time beside the estimator's prediction.

Modules, one concern each: :mod:`.plan` (which mechanisms run with which layout and flags on G
GPUs), :mod:`.measure` (launching a training and reading its metrics), :mod:`.predict` (the
estimator's figures for the same configuration), :mod:`.report` (verdicts and the markdown
report), :mod:`.check` (the command: device probe, budget, order). docs/gpu_check.md describes
the report. Everything but the launch itself runs on CPU; tests/unit/megatron/memo_tools/gpu_check/test_gpu_check.py covers it.
"""
