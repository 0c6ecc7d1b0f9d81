"""What a local run says on the terminal while it runs, read from the objects as the operator and the kubelet
leave them in the in-memory API: the job's status (a line per step, compact on a terminal; a restart's
message; a resize), its JobSets (when all of an attempt's processes are ready) and its pods (a process's
exit code)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TextIO

from ..api import names
from ..controller.phases import JobSetView

Obj = dict[str, Any]


@dataclass
class Narrator:
    job: str  # the job's name: its JobSet's and its pods'
    total: int  # the job's steps
    out: TextIO
    step: int | None = None
    said: set[tuple[str, ...]] = field(default_factory=set)  # what was said once already
    hosts: dict[str, set[str]] = field(default_factory=dict)  # JobSet uid -> its pods' hostnames
    attempts: int = 0

    def _write(self, text: str, fresh_line: bool = False) -> None:
        tty = self.out.isatty()
        self.out.write(("\n" if fresh_line and tty and self.step is not None else "") + text)
        self.out.flush()

    def _once(self, *what: str) -> bool:
        if what in self.said:
            return False
        self.said.add(what)
        return True

    def job_seen(self, kind: str, job: Obj) -> None:
        s = job.get("status") or {}
        if s.get("step") is not None and s.get("step") != self.step:
            self.step = s["step"]
            self._metrics(s)
        restarts = str((s.get("restarts") or {}).get("total"))
        if s.get("phase") == "Restarting" and s.get("message") and self._once("restarting", restarts):
            self._write(f"{s['message']}; training resumes from the latest checkpoint\n", fresh_line=True)
        for c in s.get("conditions") or []:
            if (
                c.get("type") == "Resized"
                and c.get("reason")
                and self._once("resized", c["reason"], c.get("message", ""))
            ):
                self._write(f"resized ({c['reason']}): {c.get('message', '')}\n", fresh_line=True)
        if s.get("phase") == "Succeeded" and self.out.isatty() and self._once("succeeded"):
            self._write("\n")

    def _metrics(self, s: Obj) -> None:
        def num(key: str, form: str, scale: float = 1.0) -> str:
            return format(s[key] * scale, form) if s.get(key) is not None else "-"

        evaluated = f"  eval {s['evalLoss']:.4f}" if s.get("evalLoss") is not None else ""
        ckpt = s.get("lastCheckpointStep")
        line = (
            f"step {s['step']}/{self.total}  loss {num('loss', '.4f')}{evaluated}  step {num('stepTimeSeconds', '.3f')}s  "
            f"{num('tokensPerSecond', ',.0f')} tok/s  MFU {num('mfu', '.2f', 100)}%  ckpt {ckpt if ckpt is not None else '-'}"
        )
        self._write(f"\r\033[K{line}" if self.out.isatty() else line + "\n")

    def jobset_seen(self, kind: str, jobset: Obj) -> None:
        meta = jobset["metadata"]
        if meta["name"] != names.jobset_name(self.job) or kind == "DELETED":
            return
        view = JobSetView.of(jobset)
        hosts = self.hosts.get(meta["uid"], set())
        if view.jobs and view.ready >= view.jobs and hosts and self._once("started", meta["uid"]):
            verb = "started" if self.attempts == 0 else "restarted"
            self.attempts += 1
            self._write(f"{verb} {len(hosts)} process(es): {', '.join(sorted(hosts))}\n", fresh_line=True)

    def pod_seen(self, kind: str, pod: Obj) -> None:
        meta, status = pod["metadata"], pod.get("status") or {}
        labels = meta.get("labels") or {}
        if labels.get(names.LABEL_JOBSET) != names.jobset_name(self.job):
            return
        hostname = pod["spec"].get("hostname") or meta["name"]
        self.hosts.setdefault(labels.get("jobset.sigs.k8s.io/jobset-uid", ""), set()).add(hostname)
        if status.get("phase") != "Failed":
            return
        for c in status.get("containerStatuses") or []:
            code = ((c.get("state") or {}).get("terminated") or {}).get("exitCode")
            if code is not None and self._once("exited", meta["uid"]):
                self._write(f"{hostname} exited with code {code}\n", fresh_line=True)
