"""LIBTPU_INIT_ARGS checked against the installed libtpu, each set in a child process.

libtpu parses LIBTPU_INIT_ARGS once per process, when the first TPU topology or client is made, and
on a bad flag it ends the process (exit status 1, no Python exception) after printing one line per
bad flag on stderr:

    ERROR: Unknown command line flag 'NAME'
    ERROR: Illegal value 'VALUE' specified for flag 'NAME'; ...

So a set of flags is tried in a child (`python -c`, a small topology of the generation, a sentinel on
stdout): accepted = exit 0 and the sentinel. The flags libtpu names are the rejected ones; a child
that fails without naming one is bisected. A word without a leading `-` is rejected here: libtpu
takes it for a positional argument and ignores it. One child (about a second) when every flag is good.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Sequence

from tpu_operator.api.contract import RejectedFlag

SENTINEL = "LIBTPU_FLAGS_ACCEPTED"
CHILD = f"""
import sys
from jax.experimental import topologies
bounds = tuple(int(d) for d in sys.argv[2].split("x"))
topo = topologies.get_topology_desc(platform="tpu", topology_name=sys.argv[1], chip_config_name="default",
                                    chips_per_host_bounds=bounds, num_slices=1, wrap=(False, False, False))
print("{SENTINEL}", topo.devices[0].device_kind, flush=True)
"""
ERROR = re.compile(
    r"^ERROR: (Unknown command line flag '([^']+)'.*|Illegal value '.*' specified for flag '([^']+)'.*)$", re.M
)
# A small slice of each generation as libtpu names it (plan.py), and its chips-per-host bounds.
SMALLEST = {"v7x": ("tpu7x:1x1x1", "1x1x1"), "v6e": ("v6e:1x1", "1x1x1"), "v5p": ("v5p:2x2x1", "2x2x1")}


def _name(flag: str) -> str:
    return flag.lstrip("-").split("=", 1)[0].split(None, 1)[0]


def _try(flags: Sequence[str], topology: tuple[str, str], timeout_s: float) -> tuple[bool, dict[str, str], str]:
    """(accepted, {flag name: libtpu's message}, stderr's error lines) of one child."""
    env = {**os.environ, "LIBTPU_INIT_ARGS": " ".join(flags), "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "JAX_PLATFORMS": "cpu"}
    try:
        p = subprocess.run(
            [sys.executable, "-c", CHILD, *topology], env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return False, {}, f"the check did not finish in {timeout_s:.0f} s"
    named = {m.group(2) or m.group(3): m.group(0) for m in ERROR.finditer(p.stderr)}
    tail = "\n".join(line for line in p.stderr.splitlines() if "rror" in line)[-1000:]
    return p.returncode == 0 and SENTINEL in p.stdout, named, tail or f"the check exited {p.returncode}"


def rejected(flags: Sequence[str], generation: str = "v7x", timeout_s: float = 120) -> list[RejectedFlag]:
    """The flags of `flags` that libtpu refuses (empty: all accepted), with libtpu's words."""
    out = [
        RejectedFlag(flag=f, message="not a flag (no leading -): libtpu would silently ignore it")
        for f in flags
        if not f.startswith("-")
    ]
    topology = SMALLEST.get(generation, SMALLEST["v7x"])

    def bisect(group: list[str]) -> None:
        if not group:
            return
        ok, named, tail = _try(group, topology, timeout_s)
        if ok:
            return
        hits = [f for f in group if _name(f) in named]
        out.extend(RejectedFlag(flag=f, message=named[_name(f)]) for f in hits)
        if hits:
            bisect([f for f in group if f not in hits])  # the rest may still hide an unnamed failure
        elif len(group) == 1:
            out.append(RejectedFlag(flag=group[0], message=tail))
        else:
            bisect(group[: len(group) // 2])
            bisect(group[len(group) // 2 :])

    bisect([f for f in flags if f.startswith("-")])
    return out
