"""Tiny random transformers models, the oracle of the Hugging Face conversion tests
(tests/unit/megatron/memo_tools/hf_checkpoint/test_hf_checkpoint.py, tests/distributed/test_hf_checkpoint_layouts.py), a tiny
Hugging Face tokenizer folder (tests/unit/megatron/training/test_hf_tokenizer.py), and the logits of our model
loaded from a converted checkpoint through the trainer's load path."""

from __future__ import annotations

import types
from pathlib import Path

import torch

# Two layers, four heads of 16 channels; a vocabulary the trainer pads (1000 -> 1024).
TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, rms_norm_eps=1e-6)
SEQUENCE = 32


def tiny_config(family: str, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    config_class = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[family]
    values = {**TINY, **({"sliding_window": None} if family == "mistral" else {}), **overrides}
    return config_class(**values)


def save_tiny_model(directory: Path, family: str, dtype: torch.dtype = torch.float32,
                    seed: int = 0, **overrides) -> Path:
    """A transformers model of ``family`` with every weight random (norms near 1, biases
    non-zero, so that a misplaced tensor shows), saved as safetensors in ``dtype``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.1 * torch.randn_like(parameter))
            else:
                parameter.normal_(0.0, 0.1 if name.endswith("bias") else 0.05)
    model.to(dtype).save_pretrained(directory)
    return Path(directory)


BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
TOKENIZER_TEXTS = ["The quick brown fox jumps over the lazy dog.",
                   "Long-context training splits the sequence across ranks.",
                   "def forward(self, x):\n    return self.linear(x)\n"] * 10


def save_tiny_tokenizer(directory: Path) -> Path:
    """A Llama-3-style tokenizer folder: a byte-level BPE of about 300 ids (below TINY's
    vocabulary, as Qwen2's tokenizer has fewer ids than its model rows) whose post-processor
    starts every text with BOS, and a tokenizer_config.json naming EOS as transformers writes
    it."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(TOKENIZER_TEXTS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "model_max_length": 131072}))
    return directory


def tokens(vocab_size: int = TINY["vocab_size"], batch: int = 2,
           sequence: int = SEQUENCE) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab_size, (batch, sequence), generator=generator)


def hf_logits(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits (float32) of the model saved in ``directory``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """max |ours - reference| / max |reference| over the reference's vocabulary."""
    ours = ours[..., :reference.shape[-1]]
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def model_flags(checkpoint: Path) -> list[str]:
    from megatron.memo_tools.hf_checkpoint.convert import FLAGS_FILE

    return (Path(checkpoint) / FLAGS_FILE).read_text().split()


def our_logits(checkpoint: Path, ids: torch.Tensor, extra: list[str] = (),
               flags: list[str] | None = None) -> torch.Tensor:
    """Logits [b, s, padded vocabulary] of the trainer's model loaded from ``checkpoint`` by
    the trainer's load_checkpoint, in a megatron world of one that already exists; ``flags``:
    the model flags (default: those beside a converted checkpoint)."""
    from megatron.training import checkpointing
    from megatron.memo_tools.hf_checkpoint.trainer_model import build_model, trainer_args
    from megatron.training.tokenizer import padded_vocab_size

    flags = model_flags(checkpoint) if flags is None else flags
    args = trainer_args(flags + ["--load", str(checkpoint), *extra])
    args.padded_vocab_size = padded_vocab_size(args.vocab_size,
                                               args.make_vocab_size_divisible_by, 1)
    model = build_model(args, torch.float32)
    checkpointing.load_checkpoint(args, [types.SimpleNamespace(module=model)], None, None)
    model.eval()
    with torch.no_grad():
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        return model(ids, positions, attention_mask=None)


def save_gpt2_files(directory: Path, texts=TOKENIZER_TEXTS) -> tuple[Path, Path]:
    """A GPT-2-format vocab.json and merges.txt (--vocab-file, --merge-file): a byte-level BPE
    of about 300 ids learned from ``texts``, with GPT-2's ``<|endoftext|>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab, merges = tokenizer.model.save(str(directory))
    return Path(vocab), Path(merges)
