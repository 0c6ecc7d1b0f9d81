"""The local cluster's nodes, shaped like GKE's (../shared/TPU.md): TPU v7x hosts with the GKE TPU labels,
`google.com/tpu: 4` as capacity and allocatable and the `google.com/tpu` NoSchedule taint, one node pool
(`cloud.google.com/gke-nodepool`, JobSet's exclusive-placement key) per slice, and plain CPU nodes.

Two kinds of kubelet:
- kwok (annotation `kwok.x-k8s.io/node: fake`) plays the kubelet of the `4x4x4` pool (16 hosts: one 4x4x4
  slice) and of eight single-host `2x2x1` pools; its Stages (stages.yaml) run their pods;
- the project's process kubelet (kubelet.py) runs the pods bound to the `2x2x2` pool (2 hosts: the
  quickstart's slice), to two single-host `2x2x1` pools (a two-slice elastic job: test_elastic.py) and to
  the CPU node as local processes: the real trainer, the real pre-flight. The `2x2x1` ones are tainted
  `PROCESS_TAINT` so that only a job that asks for them (its toleration and node selector) lands there,
  never one of the kwok `2x2x1` jobs of the other tests.

Only the process kubelet's nodes are untainted CPU nodes, so the operator's pre-flight pods always run
for real.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ACCELERATOR = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY = "cloud.google.com/gke-tpu-topology"
NODEPOOL = "cloud.google.com/gke-nodepool"
INSTANCE_TYPE = "node.kubernetes.io/instance-type"
KWOK = "kwok.x-k8s.io/node"
TPU = "google.com/tpu"
KUBELET_LABEL = "training.tpu-operator.dev/test-kubelet"  # kwok | process: which kubelet runs this node
SINGLE_HOST_POOLS = 8  # kwok's 2x2x1 pools: as many single-host jobs can run at once
PROCESS_SINGLE_HOST_POOLS = 2  # the process kubelet's 2x2x1 pools: one two-slice job of the real trainer
PROCESS_TAINT = {"key": KUBELET_LABEL, "value": "process", "effect": "NoSchedule"}


@dataclass(frozen=True)
class Node:
    name: str
    ip: str
    kubelet: str  # "kwok" or "process"
    labels: dict[str, str] = field(default_factory=dict)
    tpu_chips: int = 0
    cpu: str = "8"
    memory: str = "32Gi"
    taints: tuple[dict[str, str], ...] = ()  # beside the TPU taint

    def manifest(self, kubelet_version: str) -> dict[str, Any]:
        resources = {
            "cpu": self.cpu,
            "memory": self.memory,
            "pods": "110",
            **({TPU: str(self.tpu_chips)} if self.tpu_chips else {}),
        }
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            KUBELET_LABEL: self.kubelet,
            **self.labels,
        }
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": labels,
                "annotations": {KWOK: "fake"} if self.kubelet == "kwok" else {},
            },
            "spec": {
                "taints": ([{"key": TPU, "value": "present", "effect": "NoSchedule"}] if self.tpu_chips else [])
                + list(self.taints)
            },
            "status": {
                "capacity": resources,
                "allocatable": resources,
                "addresses": [{"type": "InternalIP", "address": self.ip}, {"type": "Hostname", "address": self.name}],
                "nodeInfo": {
                    "kubeletVersion": kubelet_version,
                    "kubeProxyVersion": "",
                    "architecture": "amd64",
                    "operatingSystem": "linux",
                    "osImage": "tpu-operator test node",
                    "kernelVersion": "",
                    "containerRuntimeVersion": self.kubelet,
                    "machineID": self.name,
                    "systemUUID": self.name,
                    "bootID": self.name,
                },
            },
        }


def tpu_pool(pool: str, topology: str, hosts: int, kubelet: str, first_ip: tuple[int, int]) -> list[Node]:
    """One GKE TPU v7x node pool: `hosts` tpu7x-standard-4t machines of one `topology` slice."""
    labels = {
        ACCELERATOR: "tpu7x",
        TOPOLOGY: topology,
        NODEPOOL: pool,
        INSTANCE_TYPE: "tpu7x-standard-4t",
        "cloud.google.com/gke-accelerator-count": "4",
    }
    return [
        Node(
            f"{pool}-{i}",
            f"127.{first_ip[0]}.{first_ip[1]}.{i + 1}",
            kubelet,
            labels,
            tpu_chips=4,
            cpu="224",
            memory="960Gi",
        )
        for i in range(hosts)
    ]


def cluster_nodes(node_ip: str = "127.0.0.1") -> list[Node]:
    """Every node of the local cluster. The process kubelet's pods are processes on this machine: its
    nodes' address is `node_ip` (the pods use host networking, as TPU pods do)."""
    kwok_ip = (0, 2)  # kwok's nodes get loopback addresses of their own (127.0.2.x, 127.0.3.x...)
    nodes = tpu_pool("tpu7x-4x4x4", "4x4x4", 16, "kwok", kwok_ip)
    for i in range(SINGLE_HOST_POOLS):
        nodes += tpu_pool(f"tpu7x-2x2x1-{i}", "2x2x1", 1, "kwok", (0, 3 + i))
    nodes += [
        Node(n.name, node_ip, "process", n.labels, n.tpu_chips, n.cpu, n.memory)
        for n in tpu_pool("tpu7x-2x2x2", "2x2x2", 2, "process", (0, 0))
    ]
    for i in range(PROCESS_SINGLE_HOST_POOLS):
        nodes += [
            Node(n.name, node_ip, "process", n.labels, n.tpu_chips, n.cpu, n.memory, (PROCESS_TAINT,))
            for n in tpu_pool(f"tpu7x-2x2x1-p{i}", "2x2x1", 1, "process", (0, 1))
        ]
    nodes.append(Node("cpu-0", node_ip, "process", {NODEPOOL: "cpu"}, cpu="2", memory="16Gi"))
    return nodes
