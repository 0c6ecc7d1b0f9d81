"""Fixtures of the cluster suite (`pytest -m cluster`).

`cluster` (session): the local cluster of tests/cluster/launcher.py, brought up once and torn down at
the end (TPUJOB_KEEP_CLUSTER=1 leaves it up; TPUJOB_REUSE_CLUSTER=1 uses one that is up and leaves it); or, when TPUJOB_TEST_KUBECONFIG names a kubeconfig, that
cluster as it is (tests that need the local cluster's fake TPU nodes, kubelets or audit log skip there).
Without the built components the suite skips with the reason (`bash scripts/build-cluster.sh`); with
CLUSTER_REQUIRED=1, as in CI, that skip is a failure.

`chart` (session): `helm install` of charts/tpu-operator into tpu-system; `operator_kubeconfig`: a
kubeconfig holding a token of the chart's ServiceAccount (TokenRequest), so an operator started with it is
authorized by the chart's own RBAC; `operator` (module): `tpujob operator --all-namespaces` as a local
process with that kubeconfig, one per test module (the Deployment's pod cannot run here: there is no
container runtime).

When a test fails, the last lines of every component's log and of the operators' logs are added to its
report.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import launcher
from tests.cluster.build import ROOT, unavailable
from tests.cluster.kube import Cluster, audit_files
from tests.conftest import TEST_IMAGE
from tests.operator_process import Operator
from tests.prerequisites import skip_or_fail

CHART = ROOT / "charts" / "tpu-operator"
RELEASE, OPERATOR_NAMESPACE = "op", "tpu-system"
SERVICE_ACCOUNT = f"{RELEASE}-tpu-operator"
LOG_LINES = 15
_logs: list[Path] = []  # component logs of the running local cluster, for failure reports
_audit_bytes: list[int] = []  # the audit log's size when the local cluster went down


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _audit_bytes:
        terminalreporter.write_line(f"audit log of the local cluster: {_audit_bytes[0] / 2**20:.0f} MiB")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """test_rbac.py runs last: its check of the chart's ServiceAccount reads the audit log of the whole session,
    so it then covers every operator of the suite (it passes alone too, on an operator of its own)."""
    last = [item for item in items if Path(str(item.fspath)).name == "test_rbac.py"]
    items[:] = [item for item in items if item not in last] + last


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # noqa: ANN201
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown" or not report.failed:
        return
    logs = [*(p for d in _logs for p in sorted(d.glob("*.log")) if not p.name.startswith("audit"))]
    logs += [v.log_path for v in item.funcargs.values() if isinstance(v, Operator)]
    for path in logs:
        try:
            tail = "\n".join(path.read_text(errors="replace").splitlines()[-LOG_LINES:])
        except OSError:
            continue
        report.sections.append((f"last {LOG_LINES} lines of {path.name}", tail))


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    given = os.environ.get("TPUJOB_TEST_KUBECONFIG")
    if given:
        yield Cluster(Path(given))
        return
    skip_or_fail(unavailable(), "CLUSTER_REQUIRED")
    reused = launcher.current() if os.environ.get("TPUJOB_REUSE_CLUSTER") == "1" else None
    started = time.monotonic()
    running = reused or launcher.up()
    print(f"\nlocal cluster {'reused' if reused else 'up'} in {time.monotonic() - started:.0f} s ({running.dir})")
    _logs[:] = [running.logs, running.control_plane_logs]
    try:
        yield Cluster(running.kubeconfig, running.logs, running.audit_log)
    finally:
        _logs.clear()
        # How much the suite wrote to the audit log, for the record (kube-apiserver would rotate it at 100 MB
        # by default; the launcher turns that off).
        _audit_bytes[:] = [sum(p.stat().st_size for p in audit_files(running.audit_log) if p.exists())]
        if not reused and os.environ.get("TPUJOB_KEEP_CLUSTER") != "1":
            launcher.down()


@pytest.fixture(autouse=True)
def _delete_test_namespaces(request: pytest.FixtureRequest) -> Iterator[None]:
    """The namespaces a test made go when it ends (the failure report has its logs by then)."""
    yield
    if "cluster" in request.fixturenames:
        request.getfixturevalue("cluster").delete_namespaces()


@pytest.fixture(scope="session")
def local_cluster(cluster: Cluster) -> Cluster:
    """The local cluster only: its fake TPU nodes, process kubelet and audit log."""
    if not cluster.local:
        pytest.skip(
            "needs the local cluster's fake TPU nodes and audit log (not a cluster TPUJOB_TEST_KUBECONFIG names)"
        )
    return cluster


def helm_run(helm: str, cluster: Cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    home = cluster.kubeconfig.parent / "helm"
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.kubeconfig),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    result = subprocess.run([helm, *args], capture_output=True, text=True, timeout=120, env=env)
    if check:
        assert result.returncode == 0, f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result


# The operator's Deployment is installed but its pod is kept off every node: there is no container
# runtime here, so the operator runs as a local process with the Deployment's ServiceAccount instead.
NO_NODE = [
    "--set-string",
    "nodeSelector.training\\.tpu-operator\\.dev/no-such-node=true",
    # The images the chart requires (no image is published; no pod of the Deployment runs here).
    "--set",
    "image.repository=registry.example/tpu-operator",
    "--set",
    f"operator.defaultImage={TEST_IMAGE}",
]


@pytest.fixture(scope="session")
def chart(cluster: Cluster, helm: str) -> str:
    """The chart installed cluster-wide (release `op` in tpu-system); its ServiceAccount's name."""
    helm_run(helm, cluster, "uninstall", RELEASE, "-n", OPERATOR_NAMESPACE, check=False)
    helm_run(
        helm, cluster, "install", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE, "--create-namespace", *NO_NODE
    )
    return SERVICE_ACCOUNT


def chart_args(cluster: Cluster, namespace: str, release: str) -> list[str]:
    """The operator's arguments as the chart's Deployment gives them, less its ports (a local process picks
    free ones) and its leader election (each test runs its operator alone; test_leader.py elects): the
    operators under test run as the chart configures them."""
    deployment = json.loads(
        cluster.kubectl("get", "deployment", f"{release}-tpu-operator", "-n", namespace, "-o", "json").stdout
    )
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return [a for a in args if not a.startswith(("--health-port", "--metrics-port", "--standalone", "--leader-elect"))]


@pytest.fixture(scope="session")
def operator_args(cluster: Cluster, chart: str) -> list[str]:
    """The chart's operator arguments (`chart_args`)."""
    return chart_args(cluster, OPERATOR_NAMESPACE, RELEASE)


@pytest.fixture(scope="session")
def operator_kubeconfig(cluster: Cluster, chart: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cluster.token_kubeconfig(OPERATOR_NAMESPACE, chart, tmp_path_factory.mktemp("sa") / "kubeconfig")


@pytest.fixture(scope="module")
def operator(
    operator_kubeconfig: Path, operator_args: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    """One operator per test module, as the chart runs it (every namespace, direct metrics access) and as
    the chart's ServiceAccount, reading metrics every 2 s and resyncing every 5 s (the chart's 15 and 60
    would only make the tests slower); a module that runs operators of its own does not ask for it."""
    op = Operator(
        operator_kubeconfig,
        tmp_path_factory.mktemp("operator"),
        *operator_args,
        "--metrics-interval=2",
        "--resync-interval=5",
    )
    try:
        yield op.start()
    finally:
        op.kill()
