"""Optional, online: does a zone offer the job's TPU generation and topology?

Asks the Cloud TPU API (`TpuClient.list_accelerator_types`, REST transport). Any failure to ask
(no credentials, no network, no google-cloud-tpu installed) is reported as "could not check":
the offline validation already passed and stays the answer.
"""

from __future__ import annotations

from typing import Any

from .models import TPUTrainingJob

# Accelerator-type names start with these per generation (e.g. tpu7x-128, v6e-16, v5p-128).
TYPE_PREFIXES = {"v7x": ("tpu7x", "v7x"), "v6e": ("v6e",), "v5p": ("v5p",)}


def check_capacity(
    job: TPUTrainingJob,
    project: str | None,
    zone: str | None,
    *,
    api_endpoint: str | None = None,
    credentials: Any = None,
) -> str:
    gen, topology = job.spec.tpu.generation, job.spec.tpu.topology
    if not (project and zone):
        return "capacity: could not check: both --project and --zone are needed"
    try:
        from google.cloud import tpu_v2
    except ImportError:
        return "capacity: could not check: google-cloud-tpu is not installed (pip install 'tpu-operator[cloud]')"
    options = {"api_endpoint": api_endpoint} if api_endpoint else None
    try:
        client = tpu_v2.TpuClient(transport="rest", client_options=options, credentials=credentials)
        types = list(client.list_accelerator_types(parent=f"projects/{project}/locations/{zone}"))
    except Exception as exc:  # auth, network and API errors all mean the same thing here
        return f"capacity: could not check {zone}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    offered = [t for t in types if t.type_.startswith(TYPE_PREFIXES[gen])]
    matching = [t for t in offered if any(c.topology == topology for c in t.accelerator_configs)]
    if matching:
        return f"capacity: {zone} offers {gen} {topology} (accelerator type {matching[0].type_})"
    if not offered:
        return f"capacity: {zone} offers no {gen} accelerator types"
    listed = sorted({c.topology for t in offered for c in t.accelerator_configs})
    return f"capacity: {zone} does not offer {gen} {topology}; it offers {gen} topologies {', '.join(listed)}"
