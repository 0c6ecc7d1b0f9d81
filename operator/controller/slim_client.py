"""kubernetes_asyncio without its generated API and model classes, in the operator's own process.

The package's `__init__` imports every generated class it has: 768 models and 65 APIs, about 45 MiB of
the operator's memory (measured with tracemalloc: a third of the process at 500 jobs), for nothing, since
every request the controller makes goes through the generic `ApiClient.call_api` with untyped JSON
(kube.py, leader.py). `install()` registers `kubernetes_asyncio` and `kubernetes_asyncio.client` as bare
packages over the installed directories, then imports only the modules the controller uses: the client's
`configuration`, `exceptions`, `rest` and `api_client` (its `models` import gets an empty package: a
response typed "object" never looks a class up there) and the real `config` package (kubeconfig, exec
plugins, in-cluster credentials), which finds `ApiClient` and `Configuration` on the bare client package.

Only `tpujob operator` calls it, before anything imports kubernetes_asyncio: a process that has imported the
full client already (tests, the benchmarks' floor) keeps it, and so does an installed layout other than
the expected one (the normal import then stands, and only the memory is lost).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types

log = logging.getLogger(__name__)
ROOT = "kubernetes_asyncio"
USED = ("configuration", "exceptions", "rest", "api_client")


def _bare(name: str, path: str) -> types.ModuleType:
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [path]
    module = importlib.util.module_from_spec(spec)
    module.__path__ = [path]
    sys.modules[name] = module
    return module


def install() -> bool:
    """The bare packages and the modules used; False where nothing was changed (see the module docstring)."""
    if any(name == ROOT or name.startswith(ROOT + ".") for name in sys.modules):
        return False
    spec = importlib.util.find_spec(ROOT)  # a top-level lookup: it runs no package code
    if spec is None or not spec.submodule_search_locations:
        return False
    root = spec.submodule_search_locations[0]
    client_dir = os.path.join(root, "client")
    if not all(os.path.isfile(os.path.join(client_dir, f"{m}.py")) for m in USED):
        return False
    added = [ROOT, f"{ROOT}.client", f"{ROOT}.client.models"]
    try:
        package = _bare(ROOT, root)
        client = _bare(f"{ROOT}.client", client_dir)
        _bare(f"{ROOT}.client.models", os.path.join(client_dir, "models"))
        used = {name: importlib.import_module(f"{ROOT}.client.{name}") for name in USED}
        for name, module in used.items():
            setattr(client, name, module)
        # What `from kubernetes_asyncio.client import ...` asks of the client package (config's loaders do).
        setattr(client, "ApiClient", used["api_client"].ApiClient)  # noqa: B010 (a module made here)
        setattr(client, "Configuration", used["configuration"].Configuration)  # noqa: B010
        setattr(client, "ApiException", used["exceptions"].ApiException)  # noqa: B010
        setattr(package, "client", client)  # noqa: B010
        setattr(package, "config", importlib.import_module(f"{ROOT}.config"))  # noqa: B010
    except (ImportError, AttributeError) as exc:  # another layout: back to the whole package
        for name in [n for n in sys.modules if n == ROOT or n.startswith(ROOT + ".")]:
            del sys.modules[name]
        log.info("kubernetes_asyncio imported whole (%s: %s)", type(exc).__name__, exc)
        return False
    log.debug("kubernetes_asyncio without its generated classes (%s)", ", ".join(added))
    return True
