"""Evaluation slots on a cluster: Ray placement groups and Slurm jobs, beside the local launcher.

Each slot runs one torchrun agent per node (:mod:`~areal_eval.clusters.node_agent`) and looks
to the flow like a local warm worker group: ``run(spec, timeout_s) -> (exit code, log)``, with
the result and its per-item files written where a local job would write them.
"""
