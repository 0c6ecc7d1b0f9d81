"""The controller: `tpujob operator`, which keeps each TPUTrainingJob's JobSet and status in step.

main            process set-up: settings, logging, metrics endpoint
handlers        the kopf handlers, each a line or two handing over to the manager
manager         the watches' indices, the work queue's workers, what sets each reconcile going
queue           the rate-limited work queue, where transient failures are retried
reconcile       the level-triggered logic over a small API-client protocol: converge, observe, act
kube            the Kubernetes API as the controller uses it (the `Kube` protocol and its client)
slim_client     kubernetes_asyncio without its generated classes, in the operator's process
children        a job's ConfigMap, JobSet and pre-flight Job: made to exist, adopted, replaced
admitted        the pod shapes the API server admitted lately: one dry run per shape, not per job
trimmed         what the indices keep of a job and a JobSet: the fields the reconcile reads
drift           hand edits of what the operator rendered on the JobSet and ConfigMap: put back, or reported
steps           the status pipeline: the new status and its Events from what one reconcile observed (pure)
status          how each thing the controller learns changes a job's status (pure)
phases          JobSet status -> job phase, conditions and Events (pure)
conditions      every condition type and reason the operator writes, and `set_condition` (pure)
diagnosis       why a job's pods are not running, read from the pods (pure)
restarts        restarts and hangs as the operator sees them (the rule is api/failures.py; pure)
growback        growing an elastic job back to every slice: the probe JobSet
health          TPU node health: which of a job's nodes GKE says are unhealthy (pure)
kueue           a queued job as Kueue sees it, from the JobSet's Workload (pure)
preflight       the pre-flight: the compile check before the JobSet is created
profiles        profiles on demand: the annotation sent to the trainer and followed in status.profile
accounting      the goodput ledger moved along by what a reconcile saw (pure)
metrics_reader  the trainer's /status, read from pod 0 of slice 0
bounded         a trainer's answer read as untrusted input: bounded in size and pace
control         the control key (one Secret per installation) and each job's token derived from it
events          Kubernetes Events about a job, posted in the background
stats           the operator's own Prometheus metrics
loop_lag        how late the event loop runs
rbac            the RBAC rules the operator needs
leader          leader election on a Lease: only the replica holding it acts
"""
