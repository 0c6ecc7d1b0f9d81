"""Hostile and careless inputs (issue 27), each through `tpujob validate`: refused with one clear error naming
the field or the place in the file, exit 2, no traceback, nothing on stdout, every line short and free of
terminal control characters. In-process through the CLI's entry point (2 cores: a process per case would
cost seconds each); the last test runs a few through a real `tpujob` process."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.hostile_cases import CASES, replaced
from tpu_operator import cli

CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@pytest.mark.parametrize("text,named", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_input_is_one_clear_error(text, named, tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    code = cli.main(["validate", "-f", str(path)])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == "" and "Traceback" not in err
    assert named in err, err[:2000]
    lines = err.splitlines()
    assert all(line.startswith("error: ") for line in lines), lines[:5]
    assert len(lines) <= cli.MAX_PROBLEMS_SHOWN + 1 and all(len(line) <= 1100 for line in lines), [
        len(line) for line in lines
    ][:10]
    assert not CONTROL.search(err), repr(CONTROL.search(err))


@pytest.mark.parametrize(
    "text,named",
    [
        c[1:]
        for c in CASES
        if c[0]
        in (
            "alias-bomb",
            "deep-flow-nesting",
            "duplicate-key",
            "layers-10**400",
            "elastic-10**15-microbatches",
            "annotations-over-256KiB",
            "escape-in-flag",
        )
    ],
    ids=lambda v: str(v)[:20],
)
def test_render_refuses_them_too(text, named, tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    assert cli.main(["render", "-f", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and named in err and "Traceback" not in err


def test_an_escape_is_shown_escaped_not_acted_on(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(replaced("generation: v7x", 'generation: "\\e[31mred"'))
    assert cli.main(["validate", "-f", str(path)]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\\x1b[31mred" in err, err


def test_every_valid_example_still_validates():
    # The bounds are chosen from real jobs: none of the shipped examples is near one.
    from tests.conftest import EXAMPLES

    for path in sorted(EXAMPLES.glob("*.yaml")):
        assert cli.main(["validate", "-f", str(path)]) == 0, path


@pytest.mark.parametrize("case", ["alias-bomb", "deep-flow-nesting", "5000-digit-integer", "layers-10**400"])
def test_a_real_tpujob_process_exits_2_without_a_traceback(case, tmp_path):
    ((text, named),) = [c[1:] for c in CASES if c[0] == case]
    path = tmp_path / "job.yaml"
    path.write_text(text)
    result = subprocess.run(
        [sys.executable, "-m", "tpu_operator.cli", "validate", "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and named in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert result.stdout == ""
