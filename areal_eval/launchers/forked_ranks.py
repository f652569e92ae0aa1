"""torchrun whose ranks are forked from an agent that has already imported torch, transformers
and the rank's module.

A rank that torchrun spawns imports torch and transformers on its own: 7-9 CPU-seconds per rank
here (transformers 5 pulls in ``torch.distributed.tensor`` and ``torch._dynamo``), most of what
an evaluation or a short training job costs on CPU, paid again by every rank of every job.
Forked, the ranks share the agent's imports copy-on-write and start in a fraction of a second.

Arguments are torchrun's, and the module must have ``main(argv) -> int``, which each rank calls::

    python -m areal_eval.launchers.forked_ranks --standalone --nproc-per-node=2 -m areal_eval.train --config c.json

Everything else is torchrun's own: the agent, rendezvous, failure report and exit code.

Forking is safe because the agent runs no torch computation (no OpenMP pool to inherit) and
never touches the CUDA driver (``PYTORCH_NVML_BASED_CUDA_CHECK`` makes ``is_available`` ask NVML
instead): a CUDA context does not survive ``fork``, so each rank initializes its own.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import os
import sys
import time
import uuid

NVML_CHECK = ("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
os.environ.setdefault(*NVML_CHECK)  # before torch is imported

PRELOAD = (
    "transformers.modeling_utils",
    "transformers.masking_utils",
    "transformers.activations",
    "transformers.generation.utils",
)
"""The bulk of loading any transformers model (its model file itself is small)."""


FAILED_RANK_LINGER_S = 0.3
"""How long a rank that fails by returning waits before it exits. Forked ranks are reported by
the first failure the agent sees, and a rank whose peer crashed fails a moment later (its
collective breaks): lingering lets the agent name the crashed peer, the cause."""


def run_main(module: str, *args: str) -> int:
    """In a forked rank: the module's ``main``, as ``python -m module`` would run it. A nonzero
    code exits the rank with it; a rank must return (not ``os._exit``) for torchrun to collect it."""
    from areal_eval.launchers.process_control import die_with_parent, name_process

    die_with_parent()  # the agent: if it is killed outright, its ranks go too
    name_process(f"{module.rsplit('.', 1)[-1]}-rank-{os.environ.get('RANK', '?')}")  # e.g. train-rank-1
    code = importlib.import_module(module).main(list(args))
    if code:
        time.sleep(FAILED_RANK_LINGER_S)
        raise SystemExit(code)
    return 0


def preload(module: str) -> None:
    importlib.import_module(module)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # transformers is optional for a rank that does not load models
            pass


def cheap_rendezvous_event_names() -> None:
    """torch names each rendezvous event after its caller with ``inspect.stack()``, which reads
    the source of every frame and walks every loaded module for each: with transformers loaded,
    about 0.4 CPU-seconds of a job's five here. The caller's name, from its frame alone."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:
            return "no_method_name"

    dynamic_rendezvous.get_method_name = get_method_name


JOB_MODULES = ("areal_eval.evaluation.worker", "areal_eval.train")
"""What a fork server (:mod:`areal_eval.launchers.fork_server`) imports for the jobs it will fork."""


def warm_up(*modules: str) -> None:
    """Import what an agent and its ranks need, once.

    Importing torch and transformers allocates millions of objects, and the collections they
    trigger find no garbage: off until the imports are done, the agent starts in about a fifth
    less CPU. The imported heap is then frozen, so neither the agent nor a forked rank scans it
    again, and a rank's collections leave its shared pages uncopied."""
    gc.disable()
    import torch.distributed.elastic.multiprocessing.errors  # noqa: F401
    import torch.distributed.launcher.api  # noqa: F401
    import torch.distributed.run  # noqa: F401

    cheap_rendezvous_event_names()
    for module in modules:
        preload(module)
    gc.freeze()
    gc.enable()


def main(argv: list[str] | None = None) -> None:
    from areal_eval.launchers.process_control import STACKS_SIGNAL

    # Inherited by the forked ranks: a job that should have ended shows where it is stuck.
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    gc.disable()  # until warm_up is done
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch

    args = torchrun.parse_args(argv)
    if not args.module:
        raise SystemExit("areal_eval.launchers.forked_ranks runs a module: -m MODULE")
    if args.standalone:  # as torchrun does
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    args.start_method = "fork"
    config, _, _ = torchrun.config_from_args(args)
    warm_up(args.training_script)  # all but the job's own module imported already in a fork server's agent
    record(elastic_launch(config, run_main))(args.training_script, *args.training_script_args)


if __name__ == "__main__":
    main()
