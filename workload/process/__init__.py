"""What makes the trainer a process the operator can run and read: its environment, its end, its server.

runtime      the environment contract (TPUJOB_*), jax.distributed start-up, peak FLOP/s
exits        every way the trainer ends mapped to an exit code, and the termination record
serving      process 0's hardened HTTP server (stdlib, bounded requests, the control credential)
metrics      what process 0 reports: JSON lines on stdout, /status and /metrics, TensorBoard
"""
