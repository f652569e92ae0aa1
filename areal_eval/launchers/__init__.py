"""How evaluation (and the demo's training) processes start and stop.

On this machine: torchrun jobs (:mod:`.local`) whose ranks are forked from a warm agent
(:mod:`.forked_ranks`), on the devices a plan gives them (:mod:`.devices`), and a reaper that
stops what a killed flow left (:mod:`.reaper`). On a cluster: evaluation slots on Ray and
Slurm (:mod:`.ray_slots`, :mod:`.slurm_slots`), each a torchrun agent per node (:mod:`.node_agent`), that look to
the flow like a local warm worker group.
"""
