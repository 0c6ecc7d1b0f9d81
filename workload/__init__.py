"""The JAX trainer the TPUTrainingJob pods run: `python -m tpu_workload --config FILE`.

Modules, by what they do:
  runtime     environment contract (TPUJOB_*), jax.distributed start-up, peak FLOP/s
  sharding    mesh construction, logical-axis rules, parameter-sharding check
  attention   reference and Splash attention, load-balanced context-parallel order
  moe         top-k router, dropless grouped-matmul experts (fp8 through qwix), expert parallelism
  model       the decoder (Flax NNX), remat policies, fp8 through qwix
  data        synthetic and file token batches, deterministic by step
  flops       analytic FLOPs per step (MaxText accounting)
  checkpoint  Orbax CheckpointManager wrapper
  metrics     stdout JSON lines, /status and /metrics HTTP, TensorBoard
  train       state, the train step, and the loop
"""
