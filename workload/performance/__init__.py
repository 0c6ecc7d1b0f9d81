"""What a step costs and how to make it cheaper: counted, compiled, measured, tuned.

flops          analytic FLOPs per step (MaxText's accounting) and MFU
plan           `python -m tpu_workload.performance.plan`: the step compiled for the job's slice by libtpu,
               and whether it fits
hlo_costs      FLOPs, collective bytes and HBM traffic of a compiled step, read from XLA's optimized HLO
libtpu_flags   LIBTPU_INIT_ARGS checked against the installed libtpu, in child processes
tuning         Splash block sizes and grouped-matmul tiles tuned with tune-jax, cached per chip and shape
compile_cache  JAX's persistent compilation cache beside the checkpoints
profiling      JAX profiler traces of the steps asked for (config or POST /profile), for TensorBoard
"""
