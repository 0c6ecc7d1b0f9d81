"""Fault injection and the request log, for tests that check how clients cope and what they did.

Served under `/_test/`, a prefix no Kubernetes path can have:
- `POST /_test/faults` `{"path": REGEX, "method": "GET"|"*", "status": 503, "count": 1, "message": "..."}`:
  the next `count` requests whose method matches and whose path+query `re.search`-es REGEX
  fail with `status` and a Kubernetes Status body. `GET` lists the pending faults, `DELETE` clears them.
- `POST /_test/watches/drop`: the server ends every open watch stream (clients must re-watch).
- `GET /_test/requests`: `{"items": [{"method", "path", "query", "status", "userAgent"}...]}`, oldest
  first, without the `/_test/` calls; `DELETE` clears it. A watch still streaming has status 200.
"""

import dataclasses
import itertools
import re
from typing import Any

from .errors import bad_request

ADMIN_PREFIX = "/_test/"


@dataclasses.dataclass
class Fault:
    id: int
    path: str
    method: str
    status: int
    count: int
    message: str

    def matches(self, method: str, path_qs: str) -> bool:
        return self.method in ("*", method) and re.search(self.path, path_qs) is not None


class Faults:
    def __init__(self) -> None:
        self.pending: list[Fault] = []
        self._ids = itertools.count(1)

    def add(self, spec: Any) -> Fault:
        if not isinstance(spec, dict) or not isinstance(spec.get("path"), str) or not isinstance(spec.get("status"), int):
            raise bad_request('a fault needs {"path": REGEX, "status": CODE} and optionally "method", "count", "message"')
        try:
            re.compile(spec["path"])
        except re.error as exc:
            raise bad_request(f"bad path regex: {exc}") from None
        fault = Fault(next(self._ids), spec["path"], str(spec.get("method", "*")).upper(), spec["status"],
                      int(spec.get("count", 1)), spec.get("message") or "injected fault")
        self.pending.append(fault)
        return fault

    def take(self, method: str, path_qs: str) -> Fault | None:
        """The first pending fault for this request, used up by one."""
        for fault in self.pending:
            if fault.matches(method, path_qs):
                fault.count -= 1
                if fault.count <= 0:
                    self.pending.remove(fault)
                return fault
        return None

    def describe(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(fault) for fault in self.pending]
