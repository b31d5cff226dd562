"""Does tools/eval_long_context.py measure passkey retrieval? A tiny GPT trained here on passkey
prompts must find keys it never saw, and the same model after one step must not.

1. Corpus: passkey prompts built by the tool's own PasskeyPrompts with the demo BPE tokenizer
   (tools/prepare_demo_data.py), each followed by its answer and padded with EOD to
   --seq-length tokens, so that every training sample is one whole prompt from its first
   token, as the evaluation's are (--eod-mask-loss: no loss after the first EOD). Lengths are
   uniform from the shortest prompt to --seq-length, depths uniform in [0, 1]. The keys come
   from another seed and leave out every key the evaluation asks for.
2. pretrain_gpt.py trains on it in one process: a checkpoint after iteration 1
   (--exit-interval 1), then the same run resumed to the last iteration (checkpoints every
   500 iterations).
3. tools/eval_long_context.py evaluates both (--use-checkpoint-args, one process) at prompt
   lengths shorter than, equal to and twice the training length, five depths, held-out keys.

    python bench/passkey.py [--workdir DIR]
Writes bench/results/passkey.md, and the trained model's report PNG as passkey.png; the
corpus, checkpoints, training logs and reports stay in --workdir when given.
"""

from __future__ import annotations

import json
import argparse
import random
import re
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
SEQ_LENGTH = 128
ITERATIONS = 3000
TRAIN_DOCUMENTS = 16 * ITERATIONS  # one epoch
CORPUS_SEED = 7
EVAL = {"lengths": [96, 128, 256], "depths": [0.0, 0.25, 0.5, 0.75, 1.0], "samples": 10,
        "digits": 5, "seed": 1234}
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0"]
TRAINING = ["--seq-length", str(SEQ_LENGTH), "--micro-batch-size", "16",
            "--global-batch-size", "16", "--lr", "3e-3", "--min-lr", "3e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "30", "--weight-decay", "0.1",
            "--eod-mask-loss", "--train-iters", str(ITERATIONS), "--split", "100,0,0",
            "--eval-iters", "0", "--log-interval", "25", "--save-interval", "500",
            "--seed", "1234"]


def demo_tokenizer() -> Path:
    """The demo BPE tokenizer's file, prepared first where `make demo` has not run."""
    if not (DEMO / "manifest.json").is_file():
        subprocess.run([sys.executable, "tools/prepare_demo_data.py"], cwd=REPO, check=True)
    return DEMO / "tokenizer.json"


def tokenizer_flags() -> list[str]:
    return ["--tokenizer-type", "BPETokenizer", "--tokenizer-model", str(demo_tokenizer())]


def write_corpus(prefix: Path, documents: int, seq_length: int, held_out: set[str],
                 seed: int) -> None:
    """``documents`` passkey prompts with their answers, as an indexed dataset (.bin/.idx) at
    ``prefix``; no key of ``held_out``. Each is padded with EOD to seq_length tokens, its
    length (answer and first EOD included) uniform from the shortest prompt to seq_length."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron.memo_tools.long_context_eval.passkey import PasskeyPrompts, draw_keys
    from megatron.training.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("BPETokenizer", str(demo_tokenizer()))
    prompts = PasskeyPrompts(tokenizer)
    rng = random.Random(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(documents):
        key = draw_keys(1, EVAL["digits"], rng)[0]
        while key in held_out:
            key = draw_keys(1, EVAL["digits"], rng)[0]
        answer = prompts.answer(key)
        length = rng.randint(prompts.shortest(key) + len(answer) + 1, seq_length)
        ids = prompts.prompt(length - 1 - len(answer), rng.random(), key) + answer
        builder.add_document(torch.tensor(ids + [tokenizer.eod] * (seq_length - len(ids))),
                             [seq_length])
    builder.finalize(f"{prefix}.idx")


def train(data: Path, save: Path, extra: list[str], log: Path) -> float:
    """pretrain_gpt.py in one process, its output in ``log``; returns its seconds."""
    start = time.perf_counter()
    with open(log, "w") as out:
        result = subprocess.run([sys.executable, "pretrain_gpt.py", *MODEL, *TRAINING,
                                 "--data-path", str(data), *tokenizer_flags(), "--save",
                                 str(save), *extra], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"pretrain_gpt.py failed; see {log}")
    return time.perf_counter() - start


def losses(log: Path) -> list[float]:
    """The lm losses a training log printed."""
    return [float(match) for match in re.findall(r"lm loss: (\S+) \|", log.read_text())]


def evaluate(load: Path, data: Path, output: Path, launcher: tuple = (),
             extra: tuple = ()) -> dict:
    """tools/eval_long_context.py's record for the checkpoint under ``load``."""
    command = [*(launcher or (sys.executable,)), "tools/eval_long_context.py", "--load", str(load),
               "--use-checkpoint-args", "--seq-length", str(SEQ_LENGTH), "--data-path",
               str(data), *tokenizer_flags(), "--split", "100,0,0", "--eval-split", "train",
               "--eod-mask-loss",
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
    from megatron.memo_tools.long_context_eval.passkey import passkey_cases

    held_out = {case.key for case in passkey_cases(EVAL["lengths"], EVAL["depths"],
                                                   EVAL["samples"], EVAL["digits"], EVAL["seed"])}
    data = workdir / "passkey_text_document"
    write_corpus(data, TRAIN_DOCUMENTS, SEQ_LENGTH, held_out, CORPUS_SEED)
    seconds = train(data, workdir / "initial", ["--exit-interval", "1"],
                    workdir / "train_initial.log")
    shutil.copytree(workdir / "initial", workdir / "trained")
    seconds += train(data, workdir / "trained", ["--load", str(workdir / "trained")],
                     workdir / "train.log")
    return {
        "held_out_keys": len(held_out),
        "training_seconds": seconds,
        "losses": losses(workdir / "train.log"),
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None,
                        help="Keep the corpus, checkpoints, logs and reports here (new or empty).")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="passkey_") as scratch:
        workdir = options.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        results = run(workdir)
        shutil.copyfile(workdir / "eval_trained" / "eval_long_context.png",
                        RESULTS / "passkey.png")
    trained = results["trained"]
    text = "\n".join([
        "# Passkey retrieval: a check of tools/eval_long_context.py",
        "",
        f"`python bench/passkey.py` on {machine()}, commit {commit()}.",
        "",
        f"A GPT of 4 layers (hidden 64, 4 heads, RoPE, RMSNorm, SwiGLU) trained in one process "
        f"on {TRAIN_DOCUMENTS} passkey prompts (the tool's prompt, the demo BPE tokenizer, "
        f"depths uniform in [0, 1], lengths uniform up to {SEQ_LENGTH} tokens), one per "
        f"sequence, padded with EOD (`--eod-mask-loss`): "
        f"{ITERATIONS} iterations of 16 sequences, lm loss {results['losses'][0]:.3f} at "
        f"iteration 25 and {results['losses'][-1]:.3f} at {ITERATIONS} "
        f"({results['training_seconds']:.0f} s for both runs). The evaluation asks "
        f"for {results['held_out_keys']} keys ({EVAL['digits']} digits, seed {EVAL['seed']}), "
        f"none of them in the training corpus; {EVAL['samples']} keys per length and depth "
        f"(depths {', '.join(f'{d:g}' for d in EVAL['depths'])}), greedy decoding of "
        f"{trained['passkey']['generated_tokens']} tokens. Correct: the continuation's first "
        "number is the key. Perplexity: 16 training sequences.",
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
    from megatron.memo_tools.long_context_eval.report import markdown

    section = markdown({**record, "perplexity": None}).split("## Passkey retrieval")[1]
    return section.splitlines()[2:]


if __name__ == "__main__":
    main()
