"""Rendering: a pure function from a validated job to the manifests that run it.

manifests    the ConfigMap and the JobSet, from the templates in templates/
libtpu       LIBTPU_INIT_ARGS and XLA_FLAGS for a generation and runtime settings
placement    GKE node selectors and tolerations of each capacity mode, Kueue's labels of a queued job
preflight    the plan as a command: what `tpujob plan` runs here, and the pre-flight batch Job
plan_report  a plan's result in words: `tpujob plan`'s lines, the status problems of a job that must change
summary      the readable plan `tpujob validate` prints
"""
