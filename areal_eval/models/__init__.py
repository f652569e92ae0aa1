"""Model builders and loaders: the reward model, causal LMs, training objectives, pretrained weights."""
