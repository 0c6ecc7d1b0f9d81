"""Discovery documents: /api, /apis, /apis/<group>, /api/v1, /apis/<group>/<version>, /version.

Only the legacy (unaggregated) form is served: clients that ask for aggregated discovery
(`as=APIGroupDiscoveryList`) see a plain `application/json` answer and fall back to it.
"""

from collections.abc import Iterable
from typing import Any

from .resources import ResourceType

VERSION = {
    "major": "1", "minor": "32", "gitVersion": "v1.32.0-kubeapi", "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.23", "compiler": "gc",
    "platform": "linux/amd64",
}


def _versions_by_group(types: Iterable[ResourceType]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for rt in types:
        versions = groups.setdefault(rt.group, [])
        if rt.version not in versions:
            versions.append(rt.version)
    return groups


def _group(name: str, versions: list[str]) -> dict[str, Any]:
    entries = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": entries, "preferredVersion": entries[0]}


def api_versions() -> dict[str, Any]:
    return {"kind": "APIVersions", "apiVersion": "v1", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}


def api_group_list(types: Iterable[ResourceType]) -> dict[str, Any]:
    groups = [_group(name, versions) for name, versions in sorted(_versions_by_group(types).items()) if name]
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def api_group(types: Iterable[ResourceType], group: str) -> dict[str, Any] | None:
    versions = _versions_by_group(types).get(group)
    if not versions:
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(group, versions)}


def api_resource_list(types: Iterable[ResourceType], group: str, version: str) -> dict[str, Any] | None:
    selected = [rt for rt in types if rt.group == group and rt.version == version]
    if not selected:
        return None
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": [entry for rt in selected for entry in rt.discovery()],
    }


def root_paths(types: Iterable[ResourceType]) -> dict[str, Any]:
    paths = {"/api", "/api/v1", "/apis", "/version", "/healthz", "/readyz", "/livez", "/openapi/v2"}
    for name, versions in _versions_by_group(types).items():
        if name:
            paths.add(f"/apis/{name}")
            paths.update(f"/apis/{name}/{v}" for v in versions)
    return {"paths": sorted(paths)}
