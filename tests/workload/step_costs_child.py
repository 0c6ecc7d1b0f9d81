"""The TPU compiles of test_step_costs.py, in a process of their own (libtpu reads its flags once per
process and must never load into pytest's): the plan's own compile of each small TrainerConfig for its
TPU7x slice, with the size thresholds that split the MLP, the experts and the LM head lowered, so a
small model is split as the full-size examples are. XLA's dump of each step is kept in DUMP_ROOT/NAME.

    python -m tests.workload.step_costs_child DUMP_ROOT NAME=TRAINER_CONFIG_JSON ...
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from tpu_operator.api.catalogue import generation
from tpu_operator.api.contract import TrainerConfig
from tpu_operator.api.spec import RuntimeSpec
from tpu_operator.rendering.libtpu import libtpu_init_args


def main(root: str, *cases: str) -> int:
    scratch = os.path.join(root, ".dump")
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ["LIBTPU_INIT_ARGS"] = " ".join(libtpu_init_args(generation("v7x"), RuntimeSpec()))
    # Read once, at the first compile: every step's module lands here and is moved to its case.
    os.environ["XLA_FLAGS"] = f"--xla_dump_to={scratch} --xla_dump_hlo_module_re=.*train_step.*"
    from absl import flags

    flags.FLAGS.mark_as_parsed()  # tokamax reads absl flags
    from tpu_workload.loop import train
    from tpu_workload.model import loss, moe
    from tpu_workload.performance import plan

    # As at full size: the dense MLP in 4 slices of F, the experts in slices of F, the LM head in vocabulary
    # tiles (a sequence chunk's [512, 1024] activation, or [512, 2048 / tiles] f32 logits, past 256 KiB).
    train.MLP_CHUNK_BYTES = 1 << 18
    moe.EXPERT_CHUNK_BYTES = 0
    loss.LOGITS_TILE_BYTES = loss.WEIGHT_TILE_BYTES = 1 << 18
    verdicts = {}
    for case in cases:
        name, path = case.split("=", 1)
        with open(path) as f:
            cfg = TrainerConfig.model_validate_json(f.read())
        result = plan.plan(cfg, capacity_gib=96, headroom=0.1)
        verdicts[name] = result.verdict if result.verdict == "Fits" else result.message
        shutil.move(scratch, os.path.join(root, name))
    print(json.dumps(verdicts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
