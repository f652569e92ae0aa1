"""Which checkpoints to evaluate, as pure functions: the policy, probes, the oracle, curves, replay,
trigger control."""
