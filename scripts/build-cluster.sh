#!/usr/bin/env bash
# Build the local cluster's components from the Go module proxy, at the versions pinned in
# scripts/cluster-versions.env, into a cache keyed by those versions:
#   ~/.cache/tpu-operator/cluster/<versions>/bin        kubectl, etcd, kube-apiserver,
#       kube-controller-manager, kube-scheduler, kwok, kwokctl, jobset, kueue
#   ~/.cache/tpu-operator/cluster/<versions>/manifests  JobSet's and Kueue's CRDs and webhook
#       configurations, copied from the same module versions in the Go module cache
# A component already built for these pins is kept (a stamp per component), so a second run takes
# seconds; a changed pin is a new directory. Prints each binary's version and its build time.
#   bash scripts/build-cluster.sh              build what is missing (kubectl first: the tests need it)
#   bash scripts/build-cluster.sh --print-dir  print the cache directory and exit
# Needs Go (1.26: JobSet's and Kueue's go.mod say so) and the module proxy; nothing else downloads.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cluster-versions.env
cache_root=${TPUJOB_CLUSTER_CACHE:-$HOME/.cache/tpu-operator/cluster}
dir="$cache_root/k8s-$KUBERNETES-etcd-$ETCD-jobset-$JOBSET-kueue-$KUEUE-kwok-$KWOK"
if [[ ${1:-} == --print-dir ]]; then echo "$dir"; exit 0; fi
command -v go >/dev/null || { echo "build-cluster: no Go on PATH (the components build from the Go module proxy)" >&2; exit 1; }

bin="$dir/bin" src="$dir/src" stamps="$dir/stamps"
mkdir -p "$bin" "$src" "$stamps" "$dir/manifests"
export GOTOOLCHAIN=local GOFLAGS=-buildvcs=false CGO_ENABLED=0
started=$SECONDS
say() { printf '[build-cluster %4ds] %s\n' "$((SECONDS - started))" "$*" >&2; }

# COMPONENT COMMAND...: run the build unless the component's stamp exists; record its time.
build() {
  local name=$1 t0=$SECONDS; shift
  if [[ -e "$stamps/$name" ]]; then say "$name: cached ($(cat "$stamps/$name"))"; return; fi
  say "$name: building"
  "$@"
  echo "built in $((SECONDS - t0)) s on $(nproc) cores" >"$stamps/$name"
  say "$name: built in $((SECONDS - t0)) s"
}

# Kubernetes: k8s.io/kubernetes as a dependency of a wrapper module. Its go.mod replaces every
# staging module (k8s.io/api, ...) with ./staging/src/...; a dependency's replaces do not apply, so
# the wrapper replaces each with its published v0.N.M, taking the list from the pinned go.mod itself.
k8s_module() {
  local mod="$src/kubernetes" minor=${KUBERNETES#v1.}
  minor=${minor%%.*}
  mkdir -p "$mod"
  local upstream
  upstream=$(go mod download -json "k8s.io/kubernetes@$KUBERNETES" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  {
    echo "module tpu-operator.local/kubernetes"
    echo "go 1.26.0"
    echo "tool ("
    for cmd in kubectl kube-apiserver kube-controller-manager kube-scheduler; do echo "  k8s.io/kubernetes/cmd/$cmd"; done
    echo ")"
    echo "require k8s.io/kubernetes $KUBERNETES"
    echo "replace ("
    sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/src/.*#  \1 => \1 v0.'"${KUBERNETES#v1.}"'#p' "$upstream"
    echo ")"
  } >"$mod/go.mod"
  (cd "$mod" && go mod tidy)
}
k8s_ldflags() {
  local minor=${KUBERNETES#v1.}
  minor=${minor%%.*}
  local flags="-s -w" pkg
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X $pkg.gitVersion=$KUBERNETES -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    flags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  echo "$flags"
}
k8s_build() {  # CMD...: build these k8s.io/kubernetes/cmd/* binaries in one go build
  local pkgs=() cmd
  for cmd in "$@"; do pkgs+=("k8s.io/kubernetes/cmd/$cmd"); done
  (cd "$src/kubernetes" && go build -trimpath -ldflags "$(k8s_ldflags)" -o "$bin/" "${pkgs[@]}")
}

# A module's main package built through a wrapper module that requires it: etcd's server module has
# `replace ... => ../api` lines (so `go install ...@version` refuses it), and the module proxy answers
# 403 to the version list of JobSet and Kueue, which `go install module@version` reads (to check for
# deprecation) before it builds. A wrapper ignores its dependencies' replaces and needs no list.
wrapper_build() {  # NAME MODULE VERSION PACKAGE LDFLAGS
  local name=$1 module=$2 version=$3 package=$4 ldflags=$5 mod="$src/$1"
  mkdir -p "$mod"
  printf 'module tpu-operator.local/%s\ngo 1.26.0\ntool %s\nrequire %s %s\n' "$name" "$package" "$module" "$version" >"$mod/go.mod"
  (cd "$mod" && go mod tidy && go build -trimpath -ldflags "-s -w $ldflags" -o "$bin/$name" "$package")
}

# kwok and kwokctl: kwok's go.mod has no replace lines and the proxy lists its versions.
install_at() {  # LDFLAGS PACKAGE@VERSION...
  local ldflags=$1; shift
  GOBIN="$bin" go install -trimpath -ldflags "-s -w $ldflags" "$@"
}
kwok_flags="-X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK#v} -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=${KUBERNETES#v}"

# JobSet's and Kueue's CRDs and webhook configurations with the kustomize patches that go with them, and
# kwok's Stages, from the same module versions in the module cache.
manifests() {
  local module dir_of
  for module in jobset:sigs.k8s.io/jobset@$JOBSET kueue:sigs.k8s.io/kueue@$KUEUE; do
    dir_of=$(go mod download -json "${module#*:}" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
    rm -rf "$dir/manifests/${module%%:*}"
    mkdir -p "$dir/manifests/${module%%:*}"
    cp -r "$dir_of/config/components/crd" "$dir_of/config/components/webhook" "$dir/manifests/${module%%:*}/"
  done
  dir_of=$(go mod download -json "sigs.k8s.io/kwok@$KWOK" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  rm -rf "$dir/manifests/kwok" && mkdir -p "$dir/manifests/kwok"
  cp -r "$dir_of/kustomize/stage" "$dir/manifests/kwok/"
  chmod -R u+w "$dir/manifests"
}

say "pins: Kubernetes $KUBERNETES, etcd $ETCD, JobSet $JOBSET, Kueue $KUEUE, kwok $KWOK; $(go version)"
say "cache: $dir"
build kubernetes-module k8s_module
build kubectl k8s_build kubectl
build etcd wrapper_build etcd go.etcd.io/etcd/server/v3 "$ETCD" go.etcd.io/etcd/server/v3 ""
build control-plane k8s_build kube-apiserver kube-controller-manager kube-scheduler
build kwok install_at "$kwok_flags" "sigs.k8s.io/kwok/cmd/kwok@$KWOK" "sigs.k8s.io/kwok/cmd/kwokctl@$KWOK"
build jobset wrapper_build jobset sigs.k8s.io/jobset "$JOBSET" sigs.k8s.io/jobset "-X sigs.k8s.io/jobset/pkg/version.GitVersion=$JOBSET"
build kueue wrapper_build kueue sigs.k8s.io/kueue "$KUEUE" sigs.k8s.io/kueue/cmd/kueue "-X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE"
build manifests manifests

for b in kubectl etcd kube-apiserver kube-controller-manager kube-scheduler kwok kwokctl jobset kueue; do
  [[ -x "$bin/$b" ]] || { say "missing: $bin/$b"; exit 1; }
done
say "versions:"
{
  echo "  kubectl                 $("$bin/kubectl" version --client -o json | sed -n 's/.*"gitVersion": "\(.*\)".*/\1/p' | head -1)"
  echo "  etcd                    $("$bin/etcd" --version | sed -n 's/^etcd Version: //p')"
  for b in kube-apiserver kube-controller-manager kube-scheduler; do printf '  %-23s %s\n' "$b" "$("$bin/$b" --version | awk '{print $2}')"; done
  echo "  kwok                    $("$bin/kwok" --version 2>&1 | head -1)"
  echo "  kwokctl                 $("$bin/kwokctl" --version 2>&1 | head -1)"
  echo "  jobset                  $JOBSET (sigs.k8s.io/jobset through a wrapper module)"
  echo "  kueue                   $KUEUE (sigs.k8s.io/kueue/cmd/kueue through a wrapper module)"
} >&2
say "build times:"; for s in "$stamps"/*; do printf '  %-23s %s\n' "$(basename "$s")" "$(cat "$s")" >&2; done
say "done"
echo "$dir"
