"""The demos' data: preference pairs, prompts with answers, generated arithmetic problems."""
