"""The local runner: `tpujob run --local`, a job run by the operator's own controller on this machine.

run           validate, render, create the job in the in-memory API, run it to its end, write its status
controlplane  the operator's Manager over the in-memory API, fed by its watches, with the stand-in and the kubelet
memory_api    an API server in memory: the controller's Kube protocol, watches, owner garbage collection
jobset        JobSet, the Job controller and the scheduler over the in-memory API: pods made, JobSet status
kubelet       the process kubelet: pods as local processes, their state reported (also the cluster suite's)
pods          a pod's container as a process to start (env, fieldRefs, volumes)
narrator      the terminal's lines, read from the job's status, its JobSets and its pods
compiler      the TPU compiler run here: a job's plan (`python -m tpu_workload.performance.plan`) in a child process
report        `tpujob report`: loss, step time, MFU and where the wall time went, as a PNG
"""
