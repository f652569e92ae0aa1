"""Which checkpoints to evaluate: the pure policy, the planner that queues and records decisions,
replay on recorded curves, trigger control."""
