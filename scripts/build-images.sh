#!/usr/bin/env bash
# Build the operator and the workload images from docker/*.Dockerfile and print their sizes.
#
#   bash scripts/build-images.sh
#
# With a Docker engine this is `docker build` on the Dockerfiles' public base (python:3.11-slim).
# Without one it uses podman (`apt-get install podman debootstrap`, as root): container registries
# may be out of reach, so the base is Debian bookworm's own python3 (3.11), debootstrapped once and
# imported as localhost/bookworm-python:local, and given to both Dockerfiles as PYTHON_IMAGE.
#
# Environment (all optional):
#   ENGINE=docker|podman   default: docker when `docker info` answers, else podman
#   VARIANT=cpu|tpu        the workload variant (default cpu: the one the tests and the kind suite run)
#   OPERATOR_IMAGE         default localhost/tpu-operator:dev
#   WORKLOAD_IMAGE         default localhost/tpu-workload:dev-$VARIANT
#   BASE_IMAGE             PYTHON_IMAGE of both builds. Default: the Dockerfiles' own with docker,
#                          localhost/bookworm-python:local with podman. That one is debootstrapped
#                          when absent (from DEBIAN_MIRROR, default apt's first Debian URI).
#   ONLY=operator|workload build one image
#   FORCE=1                build even an image that is up to date (see below)
#   LOG_DIR                where the build logs go (default: a directory under /tmp, removed on success)
#   CA_BUNDLE              podman only: bind-mounted over the image's CA bundle during RUN steps
#                          (default /etc/ssl/certs/ca-certificates.crt, the host's: pip then trusts
#                          a TLS-intercepting proxy the host trusts); a mount is never committed.
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL   podman only: given to pip in the build (a mounted pip.conf)
#
# Each image is labelled with a digest of its inputs: the files its Dockerfile copies, the
# Dockerfile, .dockerignore, the base image and the build arguments. A tag that already carries
# the current digest is kept as it is, so tests/images can call this script before every session
# and pay for a build only after a change. The image a rebuilt tag replaces is removed.
set -euo pipefail
cd "$(dirname "$0")/.."

LOCAL_BASE=localhost/bookworm-python:local
DIGEST_LABEL=dev.tpu-operator.inputs-digest
VARIANT=${VARIANT:-cpu}
OPERATOR_IMAGE=${OPERATOR_IMAGE:-localhost/tpu-operator:dev}
WORKLOAD_IMAGE=${WORKLOAD_IMAGE:-localhost/tpu-workload:dev-$VARIANT}
ONLY=${ONLY:-}
FORCE=${FORCE:-0}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
keep_logs=${LOG_DIR:+1}
LOG_DIR=${LOG_DIR:-$(mktemp -d /tmp/build-images.XXXXXX)}
mkdir -p "$LOG_DIR"
t0=$SECONDS

say() { printf '[build-images %4ds] %s\n' $((SECONDS - t0)) "$*" >&2; }
die() { say "error: $*"; exit 1; }

case "$VARIANT" in cpu|tpu) ;; *) die "VARIANT must be cpu or tpu, not '$VARIANT'" ;; esac
case "$ONLY" in ""|operator|workload) ;; *) die "ONLY must be operator or workload, not '$ONLY'" ;; esac
if [[ -z ${ENGINE:-} ]]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then ENGINE=docker; else ENGINE=podman; fi
fi
case "$ENGINE" in
  podman|docker) command -v "$ENGINE" >/dev/null ||
    die "$ENGINE is not installed (Debian: apt-get install -y podman debootstrap)" ;;
  *) die "ENGINE must be docker or podman, not '$ENGINE'" ;;
esac
if [[ -z ${BASE_IMAGE+set} && $ENGINE == podman ]]; then BASE_IMAGE=$LOCAL_BASE; fi
BASE_IMAGE=${BASE_IMAGE:-}  # empty: the Dockerfiles' own

image_field() { "$ENGINE" image inspect --format "$2" "$1" 2>/dev/null || true; }  # IMAGE FORMAT

debian_mirror() {  # the first Debian (not security) URI apt uses
  local uri=""
  if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
    uri=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  fi
  if [[ -z $uri && -f /etc/apt/sources.list ]]; then
    uri=$(awk '$1 == "deb" && !/security/ {for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; exit}}' \
      /etc/apt/sources.list)
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}

# Debian bookworm with python3 and python3-venv, trimmed as debian:bookworm-slim is (no apt lists
# or caches, docs, man pages or translations): about 130 MB.
bootstrap_base() {
  [[ $EUID == 0 ]] || die "debootstrapping $LOCAL_BASE needs root"
  command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install -y debootstrap)"
  local mirror rootfs
  mirror=${DEBIAN_MIRROR:-$(debian_mirror)}
  rootfs=$(mktemp -d /tmp/bookworm-rootfs.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  say "base: debootstrap bookworm from $mirror (log: $LOG_DIR/debootstrap.log)"
  debootstrap --variant=minbase --include=python3,python3-venv bookworm "$rootfs" "$mirror" \
    >"$LOG_DIR/debootstrap.log" 2>&1 || { tail -20 "$LOG_DIR/debootstrap.log" >&2; die "debootstrap failed"; }
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/*
  mkdir -p "$rootfs/var/lib/apt/lists/partial"
  rm -f "$rootfs/etc/resolv.conf" "$rootfs/etc/hostname"  # the host's, copied by debootstrap
  find "$rootfs/usr/share/doc" -type f ! -name copyright -delete
  find "$rootfs/usr/share/doc" -type d -empty -delete
  find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
  rm -rf "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/*
  say "base: $ENGINE import -> $LOCAL_BASE"
  local -a quiet=()
  [[ $ENGINE == docker ]] || quiet=(--quiet)  # podman's progress lines; docker has no such option
  tar -C "$rootfs" -c . | "$ENGINE" import "${quiet[@]}" \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$LOCAL_BASE" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
}

# The engine's arguments common to both builds.
declare -a common=()
if [[ $ENGINE == podman ]]; then
  # chroot isolation: RUN steps work without a container runtime; no layers: the JAX venv is not
  # committed twice (about half the workload's build time) and no intermediate images are left.
  common+=(--isolation chroot --layers=false)
  [[ -f $CA_BUNDLE ]] && common+=(-v "$CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro")
  if [[ -n ${PIP_INDEX_URL:-}${PIP_EXTRA_INDEX_URL:-} ]]; then
    { echo "[global]"
      [[ -z ${PIP_INDEX_URL:-} ]] || echo "index-url = $PIP_INDEX_URL"
      [[ -z ${PIP_EXTRA_INDEX_URL:-} ]] || echo "extra-index-url = $PIP_EXTRA_INDEX_URL"
    } >"$LOG_DIR/pip.conf"
    common+=(-v "$LOG_DIR/pip.conf:/etc/pip.conf:ro")
  fi
fi
if [[ -n $BASE_IMAGE ]]; then
  if [[ $BASE_IMAGE == "$LOCAL_BASE" ]] && ! "$ENGINE" image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
    bootstrap_base
  fi
  common+=(--build-arg "PYTHON_IMAGE=$BASE_IMAGE")
fi
base_id=$(image_field "${BASE_IMAGE:-none}" '{{.Id}}')

inputs_digest() {  # DOCKERFILE [WORD...]: the files the Dockerfile copies, itself, and the words
  local file=$1; shift
  local -a copied
  mapfile -t copied < <(awk 'toupper($1) == "COPY" && $2 !~ /^--/ {for (i = 2; i < NF; i++) print $i}' "$file")
  { find "${copied[@]}" -type f ! -name '*.pyc' ! -path '*/__pycache__/*' ! -path '*.egg-info/*' -print0 |
      LC_ALL=C sort -z | xargs -0 sha256sum
    sha256sum "$file" .dockerignore
    printf '%s\n' "$@"
  } | sha256sum | cut -c1-32
}

size_mb() { image_field "$1" '{{.Size}}' | awk '{printf "%.0f MB", $1 / 1e6}'; }

build() {  # NAME DOCKERFILE TAG [BUILD-ARGUMENT...]
  local name=$1 file=$2 tag=$3; shift 3
  local digest old_id new_id start=$SECONDS
  digest=$(inputs_digest "$file" "$ENGINE" "$BASE_IMAGE" "$base_id" "$@")
  if [[ $FORCE != 1 && $(image_field "$tag" "{{index .Config.Labels \"$DIGEST_LABEL\"}}") == "$digest" ]]; then
    say "$name: $tag is up to date (inputs digest $digest)"
    return 0
  fi
  old_id=$(image_field "$tag" '{{.Id}}')
  say "$name: building $tag (log: $LOG_DIR/$name.log)"
  if ! "$ENGINE" build "${common[@]}" "$@" --label "$DIGEST_LABEL=$digest" -f "$file" -t "$tag" . \
      >"$LOG_DIR/$name.log" 2>&1; then
    tail -30 "$LOG_DIR/$name.log" >&2
    say "$name: FAILED after $((SECONDS - start)) s"
    return 1
  fi
  new_id=$(image_field "$tag" '{{.Id}}')
  if [[ -n $old_id && $old_id != "$new_id" ]]; then
    "$ENGINE" image rm "$old_id" >/dev/null 2>&1 || true  # kept if a container still uses it
  fi
  say "$name: built $tag in $((SECONDS - start)) s, $(size_mb "$tag")"
}

say "$($ENGINE --version); base ${BASE_IMAGE:-of the Dockerfiles}; workload variant $VARIANT"
declare -a pids=() tags=()
if [[ $ONLY != workload ]]; then
  build operator docker/operator.Dockerfile "$OPERATOR_IMAGE" & pids+=($!); tags+=("$OPERATOR_IMAGE")
fi
if [[ $ONLY != operator ]]; then
  build workload docker/workload.Dockerfile "$WORKLOAD_IMAGE" --build-arg "VARIANT=$VARIANT" & pids+=($!)
  tags+=("$WORKLOAD_IMAGE")
fi
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done  # both builds run side by side
((rc == 0)) || die "a build failed; logs in $LOG_DIR"
for tag in "${tags[@]}"; do printf '%-44s %s\n' "$tag" "$(size_mb "$tag")"; done
[[ -n $keep_logs ]] || rm -rf "$LOG_DIR"
say "done"
