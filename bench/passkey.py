"""Does tools/eval_long_context.py measure passkey retrieval? A tiny GPT trained here on passkey
prompts must find keys it never saw, and the same model after one step must not.

1. Corpus: passkey prompts built by the tool's own PasskeyPrompts with the demo BPE tokenizer
   (tools/prepare_demo_data.py), each followed by its answer and EOD, exactly --seq-length
   tokens, so that every training sample is one whole prompt. Depths are uniform in [0, 1].
   The keys come from another seed and leave out every key the evaluation asks for.
2. pretrain_gpt.py trains on it in one process: a checkpoint after iteration 1
   (--exit-interval 1), then the same run resumed to the last iteration, a second checkpoint.
3. tools/eval_long_context.py evaluates both (--use-checkpoint-args, one process) at prompt
   lengths up to the training length and at twice it, five depths, held-out keys.

    python bench/passkey.py            # about 5 minutes on 2 busy cores
Writes bench/results/passkey.md, and the trained model's report PNG as passkey.png.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, commit, machine, write_atomic  # noqa: E402

DEMO = REPO / "data_cache" / "demo"
RESULTS = REPO / "bench" / "results"
SEQ_LENGTH = 256
TRAIN_DOCUMENTS = 4096
ITERATIONS = 300
CORPUS_SEED = 7
EVAL = {"lengths": [128, 192, 256, 512], "depths": [0.0, 0.25, 0.5, 0.75, 1.0], "samples": 10,
        "digits": 5, "seed": 1234}
MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0"]
TRAINING = ["--seq-length", str(SEQ_LENGTH), "--micro-batch-size", "8",
            "--global-batch-size", "16", "--lr", "2e-3", "--min-lr", "2e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "20", "--weight-decay", "0.1",
            "--train-iters", str(ITERATIONS), "--split", "100,0,0", "--eval-iters", "0",
            "--log-interval", "50", "--seed", "1234"]


def tokenizer_flags() -> list[str]:
    if not (DEMO / "manifest.json").is_file():
        subprocess.run([sys.executable, "tools/prepare_demo_data.py"], cwd=REPO, check=True)
    return ["--tokenizer-type", "BPETokenizer", "--tokenizer-model", str(DEMO / "tokenizer.json")]


def write_corpus(prefix: Path, documents: int, seq_length: int, held_out: set[str],
                 seed: int) -> None:
    """``documents`` passkey prompts with their answers, seq_length tokens each with the EOD,
    as an indexed dataset (.bin/.idx) at ``prefix``; no key of ``held_out``."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron.training.long_context_eval.passkey import PasskeyPrompts, draw_keys
    from megatron.training.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("BPETokenizer", str(DEMO / "tokenizer.json"))
    prompts = PasskeyPrompts(tokenizer)
    rng = random.Random(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    written = 0
    while written < documents:
        key = draw_keys(1, EVAL["digits"], rng)[0]
        if key in held_out:
            continue
        answer = prompts.answer(key)
        ids = prompts.prompt(seq_length - 1 - len(answer), rng.random(), key) + answer
        builder.add_document(torch.tensor(ids + [tokenizer.eod]), [seq_length])
        written += 1
    builder.finalize(f"{prefix}.idx")


def train(data: Path, save: Path, extra: list[str]) -> float:
    """pretrain_gpt.py in one process; returns its seconds."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "pretrain_gpt.py", *MODEL, *TRAINING,
                             "--data-path", str(data), *tokenizer_flags(), "--save", str(save),
                             *extra], cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"pretrain_gpt.py failed:\n{result.stdout[-3000:]}\n"
                           f"{result.stderr[-3000:]}")
    return time.perf_counter() - start


def evaluate(load: Path, data: Path, output: Path, launcher: tuple = (),
             extra: tuple = ()) -> dict:
    """tools/eval_long_context.py's record for the checkpoint under ``load``."""
    command = [*(launcher or (sys.executable,)), "tools/eval_long_context.py", "--load", str(load),
               "--use-checkpoint-args", "--seq-length", str(SEQ_LENGTH), "--data-path",
               str(data), *tokenizer_flags(), "--split", "100,0,0", "--eval-split", "train",
               "--eval-samples", "16", "--micro-batch-size", "8",
               "--passkey-lengths", ",".join(map(str, EVAL["lengths"])),
               "--passkey-depths", ",".join(map(str, EVAL["depths"])),
               "--passkey-samples", str(EVAL["samples"]), "--passkey-digits",
               str(EVAL["digits"]), "--seed", str(EVAL["seed"]), "--output-dir", str(output),
               *extra]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"eval_long_context.py failed:\n{result.stdout[-3000:]}\n"
                           f"{result.stderr[-3000:]}")
    return json.loads((output / "eval_long_context.json").read_text())


def run(workdir: Path) -> dict:
    """Corpus, both checkpoints and both evaluations under ``workdir``."""
    from megatron.training.long_context_eval.passkey import passkey_cases

    held_out = {case.key for case in passkey_cases(EVAL["lengths"], EVAL["depths"],
                                                   EVAL["samples"], EVAL["digits"], EVAL["seed"])}
    data = workdir / "passkey_text_document"
    write_corpus(data, TRAIN_DOCUMENTS, SEQ_LENGTH, held_out, CORPUS_SEED)
    seconds = train(data, workdir / "initial", ["--exit-interval", "1"])
    shutil.copytree(workdir / "initial", workdir / "trained")
    seconds += train(data, workdir / "trained", ["--load", str(workdir / "trained")])
    return {
        "held_out_keys": len(held_out),
        "training_seconds": seconds,
        "initial": evaluate(workdir / "initial", data, workdir / "eval_initial"),
        "trained": evaluate(workdir / "trained", data, workdir / "eval_trained"),
    }


def _row(name: str, record: dict) -> str:
    cells = {row["length"]: row for row in record["passkey"]["by_length"]}
    return (f"| {name} (iteration {record['iteration']}) | "
            + " | ".join(f"{cells[length]['correct']}/{cells[length]['total']}"
                         for length in EVAL["lengths"])
            + f" | {record['perplexity']['overall']['perplexity']:.3f} |")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="passkey_") as scratch:
        results = run(Path(scratch))
        shutil.copyfile(Path(scratch) / "eval_trained" / "eval_long_context.png",
                        RESULTS / "passkey.png")
    trained = results["trained"]
    text = "\n".join([
        "# Passkey retrieval: a check of tools/eval_long_context.py",
        "",
        f"`python bench/passkey.py` on {machine()}, commit {commit()}.",
        "",
        f"A GPT of 2 layers (hidden 128, 4 heads, RoPE, RMSNorm, SwiGLU) trained in one process "
        f"on {TRAIN_DOCUMENTS} passkey prompts of {SEQ_LENGTH} tokens (the tool's prompt, the "
        f"demo BPE tokenizer, depths uniform in [0, 1]), {ITERATIONS} iterations of 16 "
        f"sequences ({results['training_seconds']:.0f} s for both runs). The evaluation asks "
        f"for {results['held_out_keys']} keys ({EVAL['digits']} digits, seed {EVAL['seed']}), "
        f"none of them in the training corpus; {EVAL['samples']} keys per length and depth "
        f"(depths {', '.join(f'{d:g}' for d in EVAL['depths'])}), greedy decoding of "
        f"{trained['passkey']['generated_tokens']} tokens. Correct: the continuation's first "
        "number is the key.",
        "",
        "| checkpoint | " + " | ".join(f"length {length}" for length in EVAL["lengths"])
        + " | perplexity on training prompts |",
        "|---|" + "---|" * (len(EVAL["lengths"]) + 1),
        _row("after one step", results["initial"]),
        _row("trained", trained),
        "",
        f"Trained length: {SEQ_LENGTH}. By length and depth, trained model:",
        "",
        *trained_markdown_passkey(trained),
        "",
        "Commands (from the tool's report):",
        "",
        "```",
        trained["command"],
        "```",
        "",
    ])
    write_atomic(RESULTS / "passkey.md", text)
    print(text)


def trained_markdown_passkey(record: dict) -> list[str]:
    from megatron.training.long_context_eval.report import markdown

    section = markdown({**record, "perplexity": None}).split("## Passkey retrieval")[1]
    return section.splitlines()[2:]


if __name__ == "__main__":
    main()
