"""A short run with a checkpoint directory writes TensorBoard scalars under <dir>/tensorboard."""

from __future__ import annotations

import struct

from conftest import trainer_config
from tensorboardX.proto import event_pb2

from tpu_workload.loop import train

FSDP8 = dict(data=1, fsdp=8, context=1, expert=1, tensor=1)


def read_scalars(logdir) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} from the TFRecord-framed event files under `logdir`: each record is
    <u64 length><u32 crc><payload><u32 crc>, the payload an Event proto."""
    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(logdir.rglob("events.out.tfevents.*")):
        buf, pos = path.read_bytes(), 0
        while pos < len(buf):
            (length,) = struct.unpack("<Q", buf[pos : pos + 8])
            event = event_pb2.Event.FromString(buf[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                scalars.setdefault(v.tag, {})[event.step] = v.simple_value
    return scalars


def test_run_writes_loss_and_mfu_scalars(tmp_path, capsys):
    cfg = trainer_config("tiny", mesh=FSDP8, steps=3, checkpoint=str(tmp_path / "ckpt"))
    summary = train.run(cfg, peak_flops_per_device=5e10)
    capsys.readouterr()
    scalars = read_scalars(tmp_path / "ckpt" / "tensorboard")
    assert sorted(scalars["train/loss"]) == sorted(scalars["train/mfu"]) == [1, 2, 3]
    assert abs(scalars["train/loss"][3] - summary.loss) < 1e-4
    assert all(0 < m < 1e3 for m in scalars["train/mfu"].values())
