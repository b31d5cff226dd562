"""Hugging Face Llama / Mistral / Qwen2 checkpoints to the trainer's checkpoint and back
(docs/hf_checkpoint.md; the commands are tools/checkpoint/convert.py and hf_args.py).

- hf_config: config.json -> the network and pretrain_gpt.py's flag line.
- rope: transformers' RoPE settings <-> the RoPE flags.
- safetensors_io: reading and writing safetensors model directories (never a pickle).
- weight_map: tensor names and layouts, both ways.
- trainer_model: the trainer's own model in a world of one.
- convert: import_hf and export_hf, through megatron.training.checkpointing (imports
  megatron.core, so it is not imported here).
- upstream_flags: Megatron-LM's converter flags and loader/saver names, each honoured, without
  effect or refused in one line; upstream_flags_doc renders docs/megatron_convert_flags.md.
"""
