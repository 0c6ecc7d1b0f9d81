"""A node agent for tests: it plays the JobSet controller, the Job controller and the kubelet of one fake
TPU node pool and one CPU node.

There is no JobSet controller, Job controller or kubelet on this machine. The agent watches JobSets through
the API and runs each one (each uid: a JobSet deleted and created again under the same name is a new
run) as local processes with the same code as `tpujob run --local` (tpu_operator.local.pods +
tpu_operator.local.supervisor, with no restarts of its own: the rendered JobSet has maxRestarts 0).
It writes what the kubelet and the JobSet controller would:
- Pod objects, labelled as JobSet and the Job controller label them, Running and ready once their
  processes start (a container without a readiness probe is ready when it runs), status.podIP
  127.0.0.1 so the operator reads metrics from the real trainer;
- when a process ends, every pod's container state as the kubelet writes it: `state.terminated`
  with exitCode, reason, finishedAt and `message`, the trainer's termination record (the file it
  wrote at $TPUJOB_TERMINATION_LOG, the local /dev/termination-log), or, as with
  `terminationMessagePolicy: FallbackToLogsOnError`, its log's tail when it wrote none (passed on
  as a record whose error is the tail's last line, which is what the operator reads of a tail);
- the JobSet status: replicatedJobsStatus counters and a Completed or Failed condition with
  terminalState.
A JobSet deleted while it runs has its processes stopped as the kubelet stops a deleted pod's:
SIGTERM, then SIGKILL after the pod's terminationGracePeriodSeconds.

It also runs the operator's pre-flight batch Jobs (label training.tpu-operator.dev/role=preflight) as one
local process each, the real `python -m tpu_workload.plan` with the pod's command, env and ConfigMap, and
reports what a kubelet and the Job controller would: a Pod whose container ends `terminated` with its exit
code and its termination message (the file at terminationMessagePath; with FallbackToLogsOnError, the
log's tail when that is empty and the exit code is not 0), and the Job's `succeeded`/`failed` counts with a
Complete or Failed condition.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch

from tpu_operator.api.contract import TrainerConfig
from tpu_operator.api.failures import PodExit
from tpu_operator.local.pods import LocalPod, free_port, job_process, local_pods
from tpu_operator.local.supervisor import Outcome, supervise

GROUP, VERSION, PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
PREFLIGHT = "training.tpu-operator.dev/role=preflight"
LOG_TAIL = 2048  # bytes of the log a kubelet keeps as the message with FallbackToLogsOnError
CONTAINER = {"name": "trainer", "image": "local", "imageID": "", "restartCount": 0}


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class NodeAgent:
    def __init__(self, kubeconfig: Path, namespace: str, workdir: Path):
        self.api_client = config.new_client_from_config(str(kubeconfig))
        self.custom = client.CustomObjectsApi(self.api_client)
        self.core = client.CoreV1Api(self.api_client)
        self.batch = client.BatchV1Api(self.api_client)
        self.batch_runs: dict[str, threading.Thread] = {}
        self.namespace, self.workdir = namespace, workdir
        self.runs: dict[str, threading.Thread] = {}  # JobSet uid -> its run
        self.deleted: set[str] = set()  # uids of JobSets deleted while running
        self.outcomes: dict[str, Outcome] = {}  # JobSet name -> its latest run's outcome
        self.pids: dict[str, list[int]] = {}  # JobSet name -> pids of the current attempt's processes
        self.attempt_pods: dict[str, list[LocalPod]] = {}
        self.started: dict[str, int] = {}  # JobSet name -> runs started
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="node-agent")
        self._batch_watcher = threading.Thread(target=self._watch_batch, daemon=True, name="node-agent-jobs")

    def start(self) -> "NodeAgent":
        self._watcher.start()
        self._batch_watcher.start()
        return self

    def stop(self) -> None:
        """Stop watching and kill every pod process; no attempt starts after this."""
        self._stop.set()
        for pids in self.pids.values():
            self._signal(pids, signal.SIGKILL)
        for thread in [*self.runs.values(), *self.batch_runs.values()]:
            thread.join(timeout=30)

    @staticmethod
    def _signal(pids: list[int], sig: int) -> None:
        for pid in pids:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                self._watch_once()
            except Exception:  # a dropped watch or the server going away: watch again unless stopping
                if self._stop.wait(0.2):
                    return

    def _watch_once(self) -> None:
        stream = watch.Watch().stream(self.custom.list_namespaced_custom_object, GROUP, VERSION,
                                      self.namespace, PLURAL, timeout_seconds=5)
        for event in stream:
            js = event["object"]
            uid = js["metadata"]["uid"]
            if event["type"] == "DELETED" and uid in self.runs and uid not in self.deleted:
                self.deleted.add(uid)
                threading.Thread(target=self._kill_deleted, args=(js,), daemon=True).start()
            elif event["type"] in ("ADDED", "MODIFIED") and not js["spec"].get("suspend") and uid not in self.runs:
                thread = threading.Thread(target=self._run, args=(js,), daemon=True, name=f"jobset-{uid}")
                self.runs[uid] = thread
                thread.start()
            if self._stop.is_set():
                return

    def _kill_deleted(self, js: dict[str, Any]) -> None:
        pids = list(self.pids.get(js["metadata"]["name"], []))
        self._signal(pids, signal.SIGTERM)
        time.sleep(_pod_spec(js).get("terminationGracePeriodSeconds", 30))
        self._signal(pids, signal.SIGKILL)

    def _patch_status(self, js: dict[str, Any], status: dict[str, Any]) -> None:
        if js["metadata"]["uid"] in self.deleted:
            return  # gone: nothing to report on
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, self.namespace, PLURAL,
                                                          js["metadata"]["name"], {"status": status})

    def _replicated(self, js: dict[str, Any], **counts: int) -> list[dict[str, Any]]:
        rjob = js["spec"]["replicatedJobs"][0]
        base = {"ready": 0, "succeeded": 0, "failed": 0, "active": 0, "suspended": 0}
        return [{"name": rjob["name"], **base, **{k: v * rjob.get("replicas", 1) for k, v in counts.items()}}]

    def _pod_name(self, pod: LocalPod, js: dict[str, Any]) -> str:
        return f"{pod.hostname}-{js['metadata']['uid'][:5]}"

    def _create_pods(self, js: dict[str, Any], pods: list[LocalPod]) -> None:
        """Pod objects as the kubelet reports them, labelled as JobSet and the Job controller label them."""
        name = js["metadata"]["name"]
        for pod in pods:
            body = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": self._pod_name(pod, js), "namespace": self.namespace, "labels": {
                    "jobset.sigs.k8s.io/jobset-name": name, "jobset.sigs.k8s.io/job-index": str(pod.slice_index),
                    "batch.kubernetes.io/job-completion-index": str(pod.host_index)}},
                "spec": {"containers": [{"name": "trainer", "image": "local"}]},
            }
            self.core.create_namespaced_pod(self.namespace, body)
            self.core.patch_namespaced_pod_status(self._pod_name(pod, js), self.namespace, {"status": {
                "phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1",
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [{**CONTAINER, "ready": True, "state": {"running": {"startedAt": _now()}}}]}})

    def _terminate_pods(self, js: dict[str, Any], pods: list[LocalPod], exits: list[PodExit]) -> None:
        """Each pod's container state as the kubelet writes it when the process ends."""
        for pod, done in zip(pods, exits):
            finished = dt.datetime.fromtimestamp(done.finished_at or time.time(), dt.timezone.utc)
            terminated = {"exitCode": done.code, "reason": "Completed" if done.code == 0 else "Error",
                          "finishedAt": finished.strftime("%Y-%m-%dT%H:%M:%SZ"),
                          "message": done.record.message() if done.record else ""}
            self.core.patch_namespaced_pod_status(self._pod_name(pod, js), self.namespace, {"status": {
                "phase": "Succeeded" if done.code == 0 else "Failed",
                "conditions": [{"type": "Ready", "status": "False"}],
                "containerStatuses": [{**CONTAINER, "ready": False, "state": {"terminated": terminated}}]}})

    def _delete_pods(self, name: str) -> None:
        self.core.delete_collection_namespaced_pod(self.namespace,
                                                   label_selector=f"jobset.sigs.k8s.io/jobset-name={name}")

    def _run(self, js: dict[str, Any]) -> None:
        name = js["metadata"]["name"]
        pod_spec = _pod_spec(js)
        config_maps = {}
        for volume in pod_spec.get("volumes", []):
            if "configMap" in volume:
                cm = self.core.read_namespaced_config_map(volume["configMap"]["name"], self.namespace)
                config_maps[cm.metadata.name] = cm.data
        trainer = TrainerConfig.model_validate_json(next(iter(config_maps.values()))["config.json"])
        env = {e["name"]: e.get("value") for e in pod_spec["containers"][0]["env"]}
        self.started[name] = self.started.get(name, 0) + 1
        workdir = self.workdir / name

        def make_pods(attempt: int) -> list[LocalPod]:
            if self._stop.is_set():
                raise RuntimeError("node agent stopped")
            return local_pods(js, config_maps, workdir, cpu_devices=trainer.devices_per_host,
                              coordinator_port=free_port(), metrics_port=int(env["TPUJOB_METRICS_PORT"]),
                              base_env={**os.environ, "TPUJOB_LINGER_SECONDS": "5"})

        def on_event(kind: str, **d: Any) -> None:
            if kind == "started":
                self.attempt_pods[name], self.pids[name] = d["pods"], d["pids"]
                self._delete_pods(name)  # the pods of the JobSet this one replaces
                self._create_pods(js, d["pods"])
                self._patch_status(js, {"replicatedJobsStatus": self._replicated(js, active=1, ready=1)})
            elif kind in ("pod_failed", "succeeded") and js["metadata"]["uid"] not in self.deleted:
                self._terminate_pods(js, self.attempt_pods[name], d["exits"])

        try:
            outcome = supervise(make_pods, workdir / "logs", decide=None,
                                grace_s=pod_spec.get("terminationGracePeriodSeconds", 30), on_event=on_event)
        except RuntimeError:
            return  # stopped by the test's teardown
        self.outcomes[name] = outcome
        condition = "Completed" if outcome.phase == "Succeeded" else "Failed"
        self._patch_status(js, {
            "terminalState": condition,
            "replicatedJobsStatus": self._replicated(js, **({"succeeded": 1} if condition == "Completed" else
                                                            {"failed": 1})),
            "conditions": [{"type": condition, "status": "True", "lastTransitionTime": _now(),
                            "reason": "AllJobsCompleted" if condition == "Completed" else "FailedJobs",
                            "message": outcome.message}],
        })

    # --- the operator's pre-flight batch Jobs: the Job controller and a kubelet -----------------------------

    def _watch_batch(self) -> None:
        while not self._stop.is_set():
            try:
                for event in watch.Watch().stream(self.batch.list_namespaced_job, self.namespace,
                                                  label_selector=PREFLIGHT, timeout_seconds=5):
                    job = self.api_client.sanitize_for_serialization(event["object"])
                    name = job["metadata"]["name"]
                    if event["type"] == "ADDED" and name not in self.batch_runs and not self._stop.is_set():
                        thread = threading.Thread(target=self._run_batch, args=(job,), daemon=True, name=f"job-{name}")
                        self.batch_runs[name] = thread
                        thread.start()
            except Exception:  # a dropped watch or the server going away: watch again unless stopping
                if self._stop.wait(0.2):
                    return

    def _run_batch(self, job: dict[str, Any]) -> None:
        name = job["metadata"]["name"]
        template = job["spec"]["template"]
        pod_spec, pod_name = template["spec"], f"{name}-{os.urandom(3).hex()[:5]}"
        config_maps = {}
        for volume in pod_spec.get("volumes", []):
            if "configMap" in volume:
                cm = self.core.read_namespaced_config_map(volume["configMap"]["name"], self.namespace)
                config_maps[cm.metadata.name] = cm.data
        argv, env, message_file = job_process(pod_spec, config_maps, self.workdir / name, os.environ)
        container = pod_spec["containers"][0]
        self.core.create_namespaced_pod(self.namespace, {
            "apiVersion": "v1", "kind": "Pod", "spec": pod_spec,
            "metadata": {"name": pod_name, "namespace": self.namespace, "labels": template["metadata"]["labels"]}})
        self.core.patch_namespaced_pod_status(pod_name, self.namespace, {"status": {
            "phase": "Running", "podIP": "127.0.0.1", "containerStatuses": [{
                "name": container["name"], "image": container["image"], "imageID": "", "restartCount": 0,
                "ready": True, "state": {"running": {"startedAt": _now()}}}]}})
        self.batch.patch_namespaced_job_status(name, self.namespace, {"status": {"active": 1, "ready": 1,
                                                                                  "startTime": _now()}})
        log = self.workdir / name / "log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            self.pids[name] = [proc.pid]
            code = proc.wait()
        if self._stop.is_set():
            return
        message = message_file.read_text() if message_file.exists() else ""
        if not message and code != 0 and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            message = log.read_bytes()[-LOG_TAIL:].decode(errors="replace")
        reason = "Completed" if code == 0 else "Error"
        self.core.patch_namespaced_pod_status(pod_name, self.namespace, {"status": {
            "phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [{
                "name": container["name"], "image": container["image"], "imageID": "", "restartCount": 0,
                "ready": False, "state": {"running": None, "terminated": {"exitCode": code, "reason": reason, "message": message,
                                                         "finishedAt": _now()}}}]}})
        done = {"type": "Complete", "status": "True", "reason": "Completed"} if code == 0 else \
            {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}
        self.batch.patch_namespaced_job_status(name, self.namespace, {"status": {
            "active": 0, "ready": 0, "succeeded" if code == 0 else "failed": 1, "completionTime": _now(),
            "conditions": [{**done, "lastTransitionTime": _now(), "message": f"exit code {code}"}]}})



def _pod_spec(js: dict[str, Any]) -> dict[str, Any]:
    return js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
