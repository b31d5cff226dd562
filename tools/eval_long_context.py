"""Long-context evaluation of a checkpoint: megatron.memo_tools.long_context_eval.cli.main
(docs/eval_long_context.md).

    python tools/eval_long_context.py --load CKPT --use-checkpoint-args --seq-length 4096 \
        --data-path data_cache/demo/demo_text_document --tokenizer-type BPETokenizer \
        --tokenizer-model data_cache/demo/tokenizer.json --split 95,5,0 \
        --passkey-lengths 1024,2048,4096 --output-dir runs/eval
"""
import sys
from pathlib import Path

# tools/ is not a package: make the repository root importable like the other tools do.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron.memo_tools.long_context_eval.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
