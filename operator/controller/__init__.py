"""The controller: `tpujob operator`, which keeps each TPUTrainingJob's JobSet and status in step.

  handlers        the kopf handlers, each a few lines calling reconcile
  reconcile       the level-triggered logic over a small API-client protocol
  phases          JobSet status -> job phase, conditions and Events (pure)
  metrics_reader  the trainer's /status, read from pod 0 of slice 0
  rbac            the RBAC rules the operator needs
  main            process set-up: settings, logging, metrics endpoint
"""
