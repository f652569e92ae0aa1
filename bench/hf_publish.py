"""How long a Hugging Face Trainer's save waits for ``PublishCheckpoints``: publishing in its own
thread (as shipped) against waiting for each publish in ``on_save``, side by side in one run.

    .venv/bin/python bench/hf_publish.py [--hidden-size 768 --layers 8 --steps 12 --save-steps 4]

One ``Trainer`` (a Llama reward model of the given size, on the CPU) carries two callbacks, each
publishing to a run directory of its own: one as shipped, one that waits for every publish
before training goes on (what a callback hashing in ``on_save`` costs). Both hash the same
files. Prints the checkpoint size, each callback's time in ``on_save`` per save, the ratio, and
one JSON line.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import emit, median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-steps", type=int, default=4)
    args = parser.parse_args()

    from areal_eval.checkpoints.manifest import Manifest
    from areal_eval.integrations.hf import PublishCheckpoints
    from areal_eval.models.objectives import ModelConfig
    from examples.hf_trainer import build_trainer

    class Timed(PublishCheckpoints):
        def __init__(self, run_dir, wait_each: bool):
            super().__init__(run_dir, api_url=None)
            self.wait_each, self.seconds = wait_each, []

        def on_save(self, args, state, control, **kwargs):
            start = time.perf_counter()
            control = super().on_save(args, state, control, **kwargs)
            if self.wait_each:
                self.wait()
            self.seconds.append(time.perf_counter() - start)
            return control

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        shipped, waiting = Timed(work / "shipped", wait_each=False), Timed(work / "waiting", wait_each=True)
        size = ModelConfig(hidden_size=args.hidden_size, num_layers=args.layers, num_heads=8)
        trainer, _ = build_trainer(work, [shipped, waiting], args.steps, args.save_steps, model=size)
        trainer.train()
        events = Manifest(work / "shipped" / "manifest.jsonl").events()
        assert [e.global_step for e in events] == [
            e.global_step for e in Manifest(work / "waiting" / "manifest.jsonl").events()
        ]
        size_mb = sum(f.size for f in events[0].files) / 1e6
    # The last save is the final one, which both wait for.
    result = {
        "checkpoint_mb": round(size_mb, 1),
        "saves": len(events),
        "on_save_p50_s": {
            "shipped": round(median(shipped.seconds[:-1]), 3),
            "waiting": round(median(waiting.seconds[:-1]), 3),
        },
        "final_save_s": {"shipped": round(shipped.seconds[-1], 3), "waiting": round(waiting.seconds[-1], 3)},
    }
    result["waiting_over_shipped"] = round(
        result["on_save_p50_s"]["waiting"] / max(result["on_save_p50_s"]["shipped"], 1e-6), 1
    )
    p50 = result["on_save_p50_s"]
    print(
        f"checkpoint {result['checkpoint_mb']} MB, {result['saves']} saves; on_save p50 (final save apart): "
        f"shipped {p50['shipped']} s, waiting for each publish {p50['waiting']} s"
    )
    emit(result)


if __name__ == "__main__":
    main()
