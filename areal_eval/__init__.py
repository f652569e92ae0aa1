"""areal-eval: evaluate LLM checkpoints while distributed training runs, without slowing it down."""
