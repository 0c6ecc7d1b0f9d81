"""The resource types the server knows: a built-in catalogue plus whatever CRDs declare."""

import dataclasses
from typing import Any

from .schema import CrdSchema

VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


@dataclasses.dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    subresources: tuple[str, ...] = ()  # e.g. ("status",)
    printer_columns: tuple[dict[str, Any], ...] = ()
    schema: CrdSchema | None = dataclasses.field(default=None, compare=False, repr=False)
    from_crd: bool = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def storage_key(self) -> tuple[str, str]:
        """Objects are stored once per group+plural, whichever version they are served as."""
        return (self.group, self.plural)

    @property
    def has_status(self) -> bool:
        return "status" in self.subresources

    def discovery(self) -> list[dict[str, Any]]:
        """The APIResource entries of this type and its subresources."""
        main = {
            "name": self.plural,
            "singularName": self.singular or self.kind.lower(),
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": VERBS,
        }
        if self.short_names:
            main["shortNames"] = list(self.short_names)
        if self.categories:
            main["categories"] = list(self.categories)
        subs = [
            {"name": f"{self.plural}/{sub}", "singularName": "", "namespaced": self.namespaced,
             "kind": self.kind, "verbs": ["get", "patch", "update"]}
            for sub in self.subresources
        ]
        return [main, *subs]


def _builtin(group: str, version: str, plural: str, kind: str, namespaced: bool = True, **extra: Any) -> ResourceType:
    return ResourceType(group, version, plural, kind, namespaced, singular=kind.lower(), **extra)


BUILTINS: tuple[ResourceType, ...] = (
    _builtin("", "v1", "namespaces", "Namespace", False, short_names=("ns",), subresources=("status",)),
    _builtin("", "v1", "nodes", "Node", False, short_names=("no",), subresources=("status",)),
    _builtin("", "v1", "configmaps", "ConfigMap", short_names=("cm",)),
    _builtin("", "v1", "secrets", "Secret"),
    _builtin("", "v1", "services", "Service", short_names=("svc",), subresources=("status",), categories=("all",)),
    _builtin("", "v1", "pods", "Pod", short_names=("po",), subresources=("status", "proxy"), categories=("all",)),
    _builtin("", "v1", "events", "Event", short_names=("ev",)),
    _builtin("", "v1", "serviceaccounts", "ServiceAccount", short_names=("sa",)),
    _builtin("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", short_names=("pvc",), subresources=("status",)),
    _builtin("apps", "v1", "deployments", "Deployment", short_names=("deploy",), subresources=("status",), categories=("all",)),
    _builtin("batch", "v1", "jobs", "Job", subresources=("status",), categories=("all",)),
    _builtin("coordination.k8s.io", "v1", "leases", "Lease"),
    _builtin("events.k8s.io", "v1", "events", "Event", short_names=("ev",)),
    _builtin("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    _builtin("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    _builtin("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False),
    _builtin("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", False),
    _builtin("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False,
             short_names=("crd", "crds"), subresources=("status",)),
)

CRD_KEY = ("apiextensions.k8s.io", "customresourcedefinitions")


def types_from_crd(crd: dict[str, Any]) -> list[ResourceType]:
    """One ResourceType per served version of a CRD."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    result = []
    for version in spec.get("versions") or []:
        if not version.get("served", True):
            continue
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        result.append(ResourceType(
            group=spec["group"],
            version=version["name"],
            plural=names["plural"],
            kind=names["kind"],
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            singular=names.get("singular") or names["kind"].lower(),
            short_names=tuple(names.get("shortNames") or ()),
            categories=tuple(names.get("categories") or ()),
            subresources=tuple(sorted((version.get("subresources") or {}).keys())),
            printer_columns=tuple(version.get("additionalPrinterColumns") or ()),
            schema=CrdSchema(schema),
            from_crd=True,
        ))
    return result


def check_crd(crd: dict[str, Any]) -> list[dict[str, str]]:
    """The few structural checks a CRD must pass before it can be served (422 causes)."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    causes = []
    for field, value in (("spec.group", spec.get("group")), ("spec.names.plural", names.get("plural")),
                         ("spec.names.kind", names.get("kind")), ("spec.versions", spec.get("versions"))):
        if not value:
            causes.append({"reason": "FieldValueRequired", "message": "Required value", "field": field})
    name = (crd.get("metadata") or {}).get("name")
    if not causes and name != f"{names['plural']}.{spec['group']}":
        causes.append({"reason": "FieldValueInvalid", "field": "metadata.name",
                       "message": f"Invalid value: {name!r}: must be spec.names.plural+\".\"+spec.group"})
    return causes
