"""Packed documents (--reset-attention-mask) at long lengths: a process's peak RSS while it
trains on sequences packed with a hundred or more documents each.

The corpus is the demo corpus (tools/prepare_demo_data.py, data_cache/demo) cut at its
paragraphs into short documents, tokenized with the demo's BPE tokenizer, EOD appended
(tools/preprocess_data.py). Each length trains a small GPT (2 layers, hidden 128, 4 heads, RoPE)
for 3 iterations in one process, micro-batch 1, with --reset-attention-mask, and reads the
trainer's ``mem_peak_rss_mib`` (metrics.jsonl). Beside it, the bytes of the [s, s] boolean mask
Megatron-LM's --reset-attention-mask builds per sample (computed, s^2 bytes: it is never built
here). Documents per sample: the sequence length over the corpus's mean document length
(tokens / documents of the tokenized corpus).

    python bench/packed_documents.py            # ~5 minutes on 2 cores
Writes bench/results/packed_documents.md and .png.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import MiB, REPO, commit, machine, seq_label, write_atomic  # noqa: E402

LENGTHS = (8192, 16384, 32768)
DEMO = REPO / "data_cache" / "demo"
RESULTS = REPO / "bench" / "results"
MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
         "--position-embedding-type", "rope", "--micro-batch-size", "1",
         "--global-batch-size", "1", "--lr", "1e-4", "--train-iters", "3", "--log-interval",
         "1", "--eval-iters", "0", "--eval-interval", "1000", "--attention-dropout", "0",
         "--hidden-dropout", "0", "--reset-attention-mask", "--eod-mask-loss"]


def short_documents(workdir: Path) -> tuple[str, int, int]:
    """(data prefix, documents, tokens) of the demo corpus cut at its paragraphs."""
    if not (DEMO / "manifest.json").is_file():
        subprocess.run([sys.executable, "tools/prepare_demo_data.py"], cwd=REPO, check=True)
    corpus = workdir / "paragraphs.jsonl"
    with open(DEMO / "corpus.jsonl") as source, open(corpus, "w") as target:
        for line in source:
            for paragraph in json.loads(line)["text"].split("\n\n"):
                if paragraph.strip():
                    target.write(json.dumps({"text": paragraph.strip()}) + "\n")
    prefix = workdir / "paragraphs"
    subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(corpus),
                    "--output-prefix", str(prefix), "--tokenizer-type", "BPETokenizer",
                    "--tokenizer-model", str(DEMO / "tokenizer.json"), "--append-eod"],
                   cwd=REPO, check=True, capture_output=True)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = f"{prefix}_text_document"
    dataset = IndexedDataset(data)  # its lengths are a view of its memory map: keep it open
    documents, tokens = len(dataset.sequence_lengths), int(dataset.sequence_lengths.sum())
    del dataset
    return data, documents, tokens


def peak_rss_mib(data: str, seq: int, workdir: Path) -> float:
    metrics = workdir / f"metrics_{seq}.jsonl"
    subprocess.run([sys.executable, "pretrain_gpt.py", *MODEL, "--seq-length", str(seq),
                    "--max-position-embeddings", str(seq), "--data-path", data,
                    "--tokenizer-type", "BPETokenizer", "--tokenizer-model",
                    str(DEMO / "tokenizer.json"), "--split", "100,0,0",
                    "--log-metrics-jsonl", str(metrics)],
                   cwd=REPO, check=True, capture_output=True)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return max(r["mem_peak_rss_mib"] for r in records if "mem_peak_rss_mib" in r)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="packed_documents_") as scratch:
        workdir = Path(scratch)
        data, documents, tokens = short_documents(workdir)
        mean = tokens / documents
        rows = [(seq, seq / mean, peak_rss_mib(data, seq, workdir)) for seq in LENGTHS]
    table = ["| sequence | documents per sample (about) | peak RSS (MiB) | "
             "Megatron-LM's [s, s] mask per sample (MiB, computed) |", "|---|---|---|---|"]
    table += [f"| {seq_label(seq)} | {docs:.0f} | {rss:.0f} | {seq * seq / MiB:.0f} |"
              for seq, docs, rss in rows]
    text = "\n".join([
        "# Packed documents: peak RSS at long lengths",
        "",
        f"`python bench/packed_documents.py` on {machine()}, commit {commit()}.",
        "",
        f"Corpus: the demo corpus cut at its paragraphs, {documents} documents, {tokens} "
        f"tokens (mean {mean:.0f} tokens per document). Model: 2 layers, hidden 128, 4 heads, "
        "RoPE, fp32 on CPU, micro-batch 1, 3 iterations, `--reset-attention-mask "
        "--eod-mask-loss`. Peak RSS: the trainer's `mem_peak_rss_mib`, the largest of the 3 "
        "iterations (the whole process: Python, torch, the data loader).",
        "",
        *table,
        "",
    ])
    write_atomic(RESULTS / "packed_documents.md", text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot([seq / 1024 for seq, _, _ in rows], [rss for _, _, rss in rows], "o-",
              label="peak RSS, packed documents (measured)")
    axis.plot([seq / 1024 for seq, _, _ in rows], [seq * seq / MiB for seq, _, _ in rows],
              "s--", label="[s, s] mask alone (computed)")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("sequence length (K tokens)")
    axis.set_ylabel("MiB")
    axis.set_title("--reset-attention-mask by document offsets")
    axis.legend()
    figure.tight_layout()
    figure.savefig(RESULTS / "packed_documents.png", dpi=120)
    print(text)


if __name__ == "__main__":
    main()
