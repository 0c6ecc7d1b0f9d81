"""The least time a compiled step can take on its generation: each resource's bound from what the step
costs per device (StepResources, read from the compiled module) and the chip's peaks (catalogue.py).

    compute  bf16 matmul FLOPs / bf16 peak + fp8 matmul FLOPs / fp8 peak
    hbm      HBM bytes read and written / HBM bandwidth
    ici      bytes a device sends over ICI / its share of one direction of the chip's ICI bandwidth
    dcn      bytes a device sends over DCN / its share of the chip's DCN bandwidth

per device, each chip's peaks shared by its devices (v7x: 2). The step takes at least the largest (every
other resource perfectly overlapped with it): that is the bound, the largest is the binding resource,
and the model FLOPs (what MFU counts) over that time at the MFU peak are the MFU ceiling. A lower
bound: nothing here runs at peak, and collectives that cannot overlap (the first gather of a layer)
only add time.
"""

from __future__ import annotations

from .catalogue import Generation
from .contract import RESOURCES, StepResources

GIB = 1 << 30


def bound(resources: StepResources, gen: Generation, precision: str) -> StepResources:
    """`resources` with boundSeconds, stepTimeBoundSeconds, binding and mfuCeiling filled in for `gen`
    (MFU against the peak of the job's `precision`, as the trainer reports it)."""
    share = gen.devices_per_chip
    bf16_flops = (resources.matmul_tflop - resources.fp8_tflop) * 1e12
    seconds = {
        "compute": bf16_flops / (gen.peak_bf16_flops / share)
        + resources.fp8_tflop * 1e12 / (gen.peak_fp8_flops / share),
        "hbm": (resources.hbm_traffic_gib or 0.0) * GIB / (gen.hbm_bandwidth / share),
        "ici": resources.ici_sent_gib * GIB / (gen.ici_bandwidth / 2 / share),
        "dcn": resources.dcn_sent_gib * GIB / (gen.dcn_bandwidth / share),
    }
    binding = max(RESOURCES, key=lambda r: seconds[r])
    step = seconds[binding]
    ceiling = None
    if resources.model_tflop is not None and step > 0:
        ceiling = _figure(resources.model_tflop * 1e12 / step / (gen.peak_flops(precision) / share))
    return resources.model_copy(
        update=dict(
            bound_seconds={r: _figure(s) for r, s in seconds.items()},
            step_time_bound_s=_figure(step),
            binding=binding,
            mfu_ceiling=ceiling,
        )
    )


def _figure(x: float) -> float:
    return float(f"{x:.4g}")
