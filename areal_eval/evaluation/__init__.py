"""Evaluating a checkpoint on separate torchrun workers: the evaluators, the worker entry point,
warm worker groups, and the job as the orchestrator starts it."""
