"""The local runner: `tpujob run --local`, a job's rendered JobSet run as processes on this machine.

run         validate, render, run, and write the status the operator would have written
pods        the JobSet's pods as processes to start (env, fieldRefs, volumes)
supervisor  start, watch and restart them with the job's restart policy (api/failures.py, api/elastic.py)
accounting  the run's goodput ledger, folded from the supervisor's events
memory_api  an API server in memory: the controller's Kube protocol, watches, owner garbage collection
jobset      JobSet, the Job controller and the scheduler over the in-memory API: pods made, JobSet status
compiler    the TPU compiler run here: a job's plan (`python -m tpu_workload.performance.plan`) in a child process
report      `tpujob report`: loss, step time, MFU and where the wall time went, as a PNG
"""
