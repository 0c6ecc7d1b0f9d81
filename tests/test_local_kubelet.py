"""The process kubelet (local/kubelet.py) with real processes: what it reports as a pod runs and ends, and how
it stops a pod being deleted. Its API is a recorder of what it was told (a PodHost)."""

import threading
import time

import pytest

from tpu_operator.local.kubelet import Kubelet

pytestmark = pytest.mark.e2e  # real processes


class Recorder:
    def __init__(self, config_maps=None):
        self.reports, self.removed, self.config_maps = [], [], config_maps or {}
        self.changed = threading.Condition()

    def report(self, pod, status):
        with self.changed:
            self.reports.append((pod["metadata"]["name"], status))
            self.changed.notify_all()

    def remove(self, pod):
        with self.changed:
            self.removed.append(pod["metadata"]["name"])
            self.changed.notify_all()

    def volumes(self, pod):
        return self.config_maps

    def wait(self, test, timeout=30):
        with self.changed:
            assert self.changed.wait_for(test, timeout), (self.reports, self.removed)


def _pod(name, script, **container):
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "labels": {}},
        "spec": {
            "nodeName": "here",
            "containers": [
                {
                    "name": "trainer",
                    "command": ["python", "-c", script],
                    "env": [
                        {"name": "GREETING", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {"name": "CONFIG", "value": "/etc/cfg/a.txt"},
                    ],
                    "volumeMounts": [{"name": "cfg", "mountPath": "/etc/cfg"}],
                    **container,
                }
            ],
            "volumes": [{"name": "cfg", "configMap": {"name": "cm"}}],
        },
    }


def _phases(recorder, name):
    return [s["phase"] for n, s in recorder.reports if n == name]


def test_a_pod_runs_as_a_process_and_its_exit_is_reported(tmp_path):
    recorder = Recorder({"cm": {"a.txt": "from the ConfigMap"}})
    kubelet = Kubelet(recorder, tmp_path)
    script = (
        "import os, sys; print(os.environ['GREETING'], open(os.environ['CONFIG']).read(), flush=True); "
        "print('BadThing: the last line', flush=True); sys.exit(3)"
    )
    kubelet.sync("ADDED", _pod("p", script, terminationMessagePolicy="FallbackToLogsOnError"))
    recorder.wait(lambda: _phases(recorder, "p")[-1:] == ["Failed"])
    running, ended = (s for _, s in recorder.reports)
    assert running["phase"] == "Running" and running["podIP"] == "127.0.0.1"
    assert {c["type"] for c in running["conditions"] if c["status"] == "True"} >= {"Ready", "ContainersReady"}
    terminated = ended["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 3 and terminated["reason"] == "Error"
    assert "BadThing: the last line" in terminated["message"]  # the log's tail: no termination message written
    log = (tmp_path / "ns" / "p-uid-p" / "log").read_text()
    assert "p from the ConfigMap" in log  # the fieldRef and the mounted file


def test_a_deleted_pod_gets_sigterm_then_its_final_delete(tmp_path):
    recorder = Recorder({"cm": {}})
    kubelet = Kubelet(recorder, tmp_path)
    # Saves on SIGTERM (writes its termination message), as the trainer does, then exits 143.
    script = (
        "import os, signal, sys, time\n"
        "def stop(*_):\n"
        "    open(os.environ['TPUJOB_TERMINATION_LOG'], 'w').write('{\"code\": 143, \"error\": \"saved\"}')\n"
        "    sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n"
    )
    pod = _pod("q", script)
    kubelet.sync("ADDED", pod)
    recorder.wait(lambda: _phases(recorder, "q") == ["Running"])
    time.sleep(0.5)  # its handler installed
    pod["metadata"].update(deletionTimestamp="2026-01-01T00:00:00Z", deletionGracePeriodSeconds=30)
    started = time.monotonic()
    kubelet.sync("MODIFIED", pod)
    recorder.wait(lambda: recorder.removed == ["q"])
    assert time.monotonic() - started < 10  # it ended on SIGTERM, well within its grace period
    terminated = recorder.reports[-1][1]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 143 and '"saved"' in terminated["message"]


def test_shutdown_kills_what_ignores_sigterm(tmp_path):
    recorder = Recorder({"cm": {}})
    kubelet = Kubelet(recorder, tmp_path)
    script = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    )
    kubelet.sync("ADDED", _pod("r", script))
    recorder.wait(lambda: _phases(recorder, "r") == ["Running"])
    time.sleep(0.5)
    (process,) = [p for p in kubelet.processes.values() if p is not None]
    kubelet.shutdown(0.5)
    assert process.poll() is not None and process.returncode == -9
