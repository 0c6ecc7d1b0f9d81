"""The cluster suite and the local cluster it runs on (`pytest -m cluster`; README, "The local cluster").

Modules: `build` (where scripts/build-cluster.sh put the pinned components), `launcher` (`python -m
tests.cluster up|down`: kwokctl's control plane, JobSet, Kueue, the nodes), `manifests` (JobSet's and
Kueue's CRDs and webhooks made to call local processes), `certs` (their webhook CA), `nodes` (GKE-shaped
TPU and CPU nodes), `stages.yaml` (kwok's pod Stages), `kubelet` (the process kubelet), `kube` (what tests
use to talk to the cluster and read its audit log), `conftest` (fixtures: the cluster, the chart, the
operator as the chart's ServiceAccount).
"""
