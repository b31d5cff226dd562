"""Long-context evaluation of a checkpoint of the trainer (tools/eval_long_context.py,
docs/eval_long_context.md): perplexity by position bucket on the trainer's dataset, and passkey
retrieval by greedy decoding, both through the trainer's own model at the training layout.

buckets: the position buckets; passkey: prompts, keys and answers; model: the model at a
layout and its two readouts; evaluate: the two measurements; report: JSON, markdown and PNG;
cli: the command line."""
