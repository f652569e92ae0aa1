"""A Slurm node agent's own directory on the node (its warm ranks, its checkpoint cache)."""

from areal_eval.launchers.slurm_node import node_dir


def test_two_controllers_jobs_of_the_same_id_get_directories_of_their_own(tmp_path):
    # Two Slurm clusters on one machine (the tests' lanes) both hand out job 7: sharing a
    # directory, one job's evaluations were served by the other's warm ranks.
    first, second = tmp_path / "slots" / "a" / "slot-0", tmp_path / "slots" / "b" / "slot-0"
    assert node_dir(tmp_path, first, "7", 0) != node_dir(tmp_path, second, "7", 0)
    assert node_dir(tmp_path, first, "7", 0) == node_dir(tmp_path, str(first), "7", 0)  # every node finds it alike
    assert node_dir(tmp_path, first, "7", 0) != node_dir(tmp_path, first, "7", 1) != node_dir(tmp_path, first, "8", 1)
    assert node_dir(tmp_path, first, "7", 1).parent.name.startswith("7-")
