"""The JAX trainer the TPUTrainingJob pods run: `python -m tpu_workload --config FILE`.

Subpackages, by role (each one's docstring lists its modules):
  model        the network and its math: the decoder, attention, MoE, the tiled loss, sharding
  data         token batches: synthetic and file sources, packing, read-ahead, the data-order fingerprint
  loop         the training loop: the step, its hooks (evaluation, checkpoints, SIGTERM, test faults),
               the trainer's clock
  process      what makes it a process: the environment contract, exit codes, the HTTP server, metrics
  performance  what a step costs and how to make it cheaper: FLOPs, the compiled plan, HLO costs,
               kernel tuning, the compilation cache, libtpu flags, profiles
  interchange  other implementations' checkpoints in and out: Hugging Face Llama 3 and Mixtral
               (spec.model.init, `tpujob convert`, `tpujob export`)

Modules here:
  __main__     `python -m tpu_workload`: start-up, the metrics server, the run, the exit code
"""
