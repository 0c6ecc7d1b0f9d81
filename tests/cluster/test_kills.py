"""An operator SIGKILLed at random moments (during its start-up, its watches' first lists, its creates, its
status writes) and started again creates each child exactly once: 20 kills over 10 jobs leave exactly one
JobSet and one ConfigMap per job, none deleted and made again (the API server's audit log)."""

from __future__ import annotations

import random
import signal
import time

import pytest

from tests.cluster.conftest import OPERATOR_NAMESPACE
from tests.cluster.jobs import namespaced
from tests.cluster.kube import JOBSETS, Cluster, wait_for
from tests.conftest import operator_job
from tests.operator_process import Operator
from tpu_operator.controller.children import config_map_of

pytestmark = pytest.mark.cluster
JOBS, KILLS = 10, 20


def test_twenty_kills_over_ten_jobs_leave_one_jobset_and_one_configmap_per_job(
    local_cluster: Cluster, chart: str, operator_kubeconfig, operator_args, tmp_path
):
    cluster, ns = local_cluster, local_cluster.namespace("kills")
    since = time.time()
    names = [f"survivor-{i}" for i in range(JOBS)]
    for name in names:
        doc = operator_job()
        doc["metadata"]["name"] = name
        cluster.apply(doc, namespace=ns)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"kill moments from random seed {seed}")
    for _ in range(KILLS):
        op = Operator(operator_kubeconfig, tmp_path, *namespaced(operator_args, ns)).start(wait=False)
        time.sleep(rng.uniform(0.5, 6.0))  # kopf's start-up takes 2-4 s here: some kills land before, most after
        op.kill(signal.SIGKILL)
    final = Operator(operator_kubeconfig, tmp_path, *namespaced(operator_args, ns)).start()
    try:
        wait_for(
            lambda: all(cluster.status(ns, n).get("jobSetName") for n in names),
            120,
            "every job's JobSet in its status",
            diagnose=lambda: final.log_tail(),
        )
    finally:
        final.kill(signal.SIGTERM)
    jobsets = {j["metadata"]["name"]: j for j in cluster.items(JOBSETS, ns)}
    config_maps = {
        c.metadata.name: c
        for c in cluster.core.list_namespaced_config_map(ns).items
        if c.metadata.name != "kube-root-ca.crt"
    }
    assert sorted(jobsets) == sorted(names), sorted(jobsets)
    assert sorted(config_maps) == sorted(config_map_of(jobsets[n]) for n in names), sorted(config_maps)
    for name in names:
        uid = cluster.job(ns, name)["metadata"]["uid"]
        assert [r["uid"] for r in jobsets[name]["metadata"]["ownerReferences"]] == [uid]
    # Each created once. A name can be POSTed successfully once unless its object is deleted (a second POST is a
    # 409), so: no JobSet or ConfigMap deleted, at most one successful POST of each per job, and exactly one of
    # each per job at the end (above). "At most": a POST cut short by a SIGKILL may have stored its object and
    # still be logged without a 201 (or without a response at all).
    user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{chart}"
    writes = [
        (e["verb"], e["objectRef"].get("resource"), (e.get("responseStatus") or {}).get("code"))
        for e in cluster.audit(since)
        if e["user"]["username"] == user
        and e["objectRef"].get("namespace") == ns
        and "dryRun=" not in e.get("requestURI", "")
    ]
    for resource in ("jobsets", "configmaps"):
        created = sum(1 for w in writes if w[:2] == ("create", resource) and w[2] == 201)
        assert 0 < created <= JOBS, (resource, writes)
        assert not [w for w in writes if w[:2] == ("delete", resource)], writes
