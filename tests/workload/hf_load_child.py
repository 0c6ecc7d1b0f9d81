"""One process of test_huggingface.py's two-process load: joins the others (4 CPU devices each), loads a
Hugging Face directory onto an fsdp x tensor mesh over every process's devices, checks each of its shards
against the checkpoint read whole with numpy, and writes the byte ranges it read as JSON.

    python -m tests.workload.hf_load_child HF_DIR COORDINATOR PROCESSES PROCESS_ID OUT_JSON
"""

from __future__ import annotations

import json
import os
import sys


def main(hf_dir: str, coordinator: str, processes: str, process_id: str, out: str) -> int:
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    jax.distributed.initialize(coordinator, num_processes=int(processes), process_id=int(process_id))
    import numpy as np
    from flax import nnx

    from tpu_workload.interchange import hf_weights, pretrained, tensorfiles
    from tpu_workload.model import decoder, sharding

    model = pretrained.hf_model(hf_dir)
    mesh = sharding.make_mesh(dict(data=1, fsdp=4, context=1, expert=1, tensor=2))
    sharder = sharding.Sharder(mesh)
    abstract = nnx.state(nnx.eval_shape(lambda: decoder.Decoder(decoder.ModelConfig(model.dims), nnx.Rngs(0))))
    shardings = jax.tree.map(
        lambda spec, a: sharder.named(tuple(spec), a.shape),
        nnx.get_partition_spec(abstract).to_pure_dict(),
        abstract.to_pure_dict(),
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )
    tensors = tensorfiles.catalogue(hf_dir)
    reads = tensorfiles.Reads()
    params = hf_weights.load_sharded(model, tensors, shardings, reads)
    whole = {name: tensorfiles.read(t, tuple(slice(None) for _ in t.shape)) for name, t in tensors.items()}
    for rule in hf_weights.rules(model.dims):  # our layout of the whole tensors, the reference
        stacked = [
            [whole[hf_weights._source(rule, model, i, e)] for e in range(model.dims.experts or 1)]
            for i in range(model.dims.layers)
        ]
        k, arr = rule.stacked, np.asarray(stacked)
        full = arr if k == 2 else arr[:, 0] if k == 1 else arr[0, 0]
        view = tuple(hf_weights.sizes(model.dims)[c] for c in rule.view)
        axes = (*range(k), *(k + rule.view.index(c) for c in rule.ours))
        ours = np.transpose(full.reshape(full.shape[:k] + view), axes).astype(np.float32)
        for shard in hf_weights._at(params, rule.path).addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), ours[shard.index], err_msg=str(rule.path))
    with open(out, "w") as f:
        json.dump({"ranges": reads.ranges, "bytes": reads.bytes}, f)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
