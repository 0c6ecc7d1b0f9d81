"""Validation problems as `field.path: reason` lines users can act on: from pydantic's errors (`problems`), and a
validator's own several joined into one message (`joined`)."""

from __future__ import annotations

import re

from pydantic import ValidationError

Problem = tuple[str, str]  # (path under spec, reason): what a validator finds, before `joined` writes it

# "field.path: reason" as a validator writes it; the last part may be a domain-prefixed map key
# (resources.limits.example.com/fpga).
_PATH_PREFIX = re.compile(
    r"^(?P<path>[A-Za-z][A-Za-z0-9]*(\.[A-Za-z][A-Za-z0-9]*)*(\.[a-z0-9][-a-z0-9.]*/[-A-Za-z0-9_.]+)?)"
    r": (?P<reason>.*)$",
    re.S,
)


# What of a user's input an error message repeats: enough to recognise it, never a page of it.
SHOWN_CHARS = 200
# Characters a terminal acts on or that reorder what it shows (C0 and C1 controls, ESC among them; the
# bidirectional overrides), written as escapes wherever a message repeats input.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """`value` as a message may repeat it: strings as written, control characters escaped, at most `limit`
    characters and a count of the rest."""
    text = value if isinstance(value, str) else repr(value)
    text = _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


_TAG_PREFIXES = (
    "constrained-",
    "function-",
    "literal[",
    "list[",
    "dict[",
    "union[",
    "tagged-union[",
    "nullable[",
    "json-or-python[",
    "lax-or-strict[",
    "is-instance[",
    "model[",
)


def _loc_part(part: object) -> str | None:
    """Drop the tags pydantic adds for union branches and validator wrappers ('int', "literal['auto']")."""
    if isinstance(part, int):
        return f"[{part}]"
    text = str(part)
    skip = text in {"int", "str", "float", "bool", "[key]"} or text.startswith(_TAG_PREFIXES)
    return None if skip else shown(text, 100)  # a map key is the user's: a path repeats it


def problems(exc: ValidationError, root: str = "") -> list[str]:
    """Every problem of `exc` as 'path: reason', one per path, in input order. A validator that finds
    several problems raises one message with a 'path: reason' per line (`joined`)."""
    by_path: dict[str, list[str]] = {}
    for err in exc.errors():
        parts = [p for p in map(_loc_part, err["loc"]) if p is not None]
        msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        for line in msg.split("\n") if err["type"] == "value_error" else [msg]:
            line_parts, line_msg = parts, line
            m = _PATH_PREFIX.match(line)
            if m and err["type"] == "value_error":  # "topology: ..." raised by a model validator names its field
                line_parts, line_msg = [*parts, m.group("path")], m.group("reason")
            if err["type"] == "literal_error" or err["type"] == "enum":
                line_msg = f"{shown(repr(err.get('input')))} is not allowed; {line_msg[0].lower()}{line_msg[1:]}"
            elif err["type"] == "extra_forbidden":
                line_msg = "unknown field"
            path = ".".join(p for p in [root, *line_parts] if p).replace(".[", "[")
            msgs = by_path.setdefault(path or "(root)", [])
            if line_msg not in msgs:
                msgs.append(line_msg)
    return [f"{path}: {' or '.join(msgs)}" for path, msgs in by_path.items()]


def joined(problems: list[Problem]) -> str:
    """One validator message for several problems, one 'path: reason' per line (read back by `problems`)."""
    return "\n".join(f"{path}: {reason}" if path else reason for path, reason in problems)
