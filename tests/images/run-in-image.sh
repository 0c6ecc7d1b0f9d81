#!/usr/bin/env bash
# Run a command in a built image the way a container runtime would, without `podman run` (which
# this sandbox refuses: crun cannot setrlimit): `podman create` + `podman mount`, then chroot into
# the mounted root inside private mount and PID namespaces, as the image's user, with the image's
# environment, entrypoint and working directory. tests/images start the images with it.
#
#   tests/images/run-in-image.sh [OPTIONS] IMAGE [ARG...]
#
#   --name NAME        container name (default: r-<random>); an old container of that name is removed
#   --user UID[:GID]   run as this user (default: the image's Config.User; root when it names none)
#   --entrypoint CMD   replace the image's entrypoint (a single word; use ARGs for the rest)
#   --workdir DIR      working directory (default: the image's Config.WorkingDir, else /)
#   -e, --env K=V      add/override an environment variable (repeatable)
#   -v, --volume H:C[:ro]  bind-mount host path H at C (file or directory; repeatable; a later
#                      one wins, so -v FILE:/etc/hosts replaces the host's hosts file)
#   --read-only        read-only root file system (a pod's readOnlyRootFilesystem)
#   --tmp-size SIZE    size of the tmpfs on /tmp (default 256m; a pod's emptyDir there)
#   --grace SECONDS    after forwarding SIGTERM/SIGINT, SIGKILL the command this much later
#                      (default 30, a pod's terminationGracePeriodSeconds)
#   --keep             leave the container created and mounted on exit (default: umount + rm)
#
# The ARGs replace the image's Cmd, as `docker run IMAGE ARG...` does. Like a kubelet, it gives the
# container a fresh /proc, a minimal /dev with a 64 MB tmpfs /dev/shm, a tmpfs /tmp, the host's
# /etc/hosts, /etc/resolv.conf and /etc/hostname, no_new_privs, and (as non-root) no capabilities.
# The process shares the host's network namespace (a pod with hostNetwork): 127.0.0.1 reaches
# servers on the host, and the host reaches its ports. Mounts made here live in the private mount
# namespace and vanish when the command exits; killing this script in any way kills the command.
# The container's own overlay mount is undone on exit, or by `podman rm -f NAME` after a SIGKILL of
# this script. Needs root (rootful podman, mount, unshare, chroot); --user must be numeric. It
# trusts the image: mount points are created inside the container's root from the host side.
set -euo pipefail

name="r-$(head -c4 /dev/urandom | od -An -tx1 | tr -d ' \n')"
user="" entrypoint="" workdir="" read_only=0 keep=0 tmp_size=256m grace=30
declare -a envs=() volumes=()
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-2}"; }
while (($#)); do
  case "$1" in
    --name) name=$2; shift 2 ;;
    --user) user=$2; shift 2 ;;
    --entrypoint) entrypoint=$2; shift 2 ;;
    --workdir) workdir=$2; shift 2 ;;
    -e|--env) envs+=("$2"); shift 2 ;;
    -v|--volume) volumes+=("$2"); shift 2 ;;
    --read-only) read_only=1; shift ;;
    --tmp-size) tmp_size=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    --grace) grace=$2; shift 2 ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    -*) echo "run-in-image: unknown option $1" >&2; usage ;;
    *) break ;;
  esac
done
(($#)) || usage
image=$1; shift

# --- the image's declared runtime configuration -------------------------------------------------
inspect() { podman image inspect --format "$1" "$image"; }
mapfile -t img_env < <(inspect '{{range .Config.Env}}{{println .}}{{end}}' | sed '/^$/d')
mapfile -t img_ep < <(inspect '{{range .Config.Entrypoint}}{{println .}}{{end}}' | sed '/^$/d')
mapfile -t img_cmd < <(inspect '{{range .Config.Cmd}}{{println .}}{{end}}' | sed '/^$/d')
[[ -n $user ]] || user=$(inspect '{{.Config.User}}')
[[ -n $workdir ]] || workdir=$(inspect '{{.Config.WorkingDir}}')
[[ -n $workdir ]] || workdir=/
[[ -n $user ]] || user=0:0
if [[ $user != *:* ]]; then user="$user:$user"; fi
uid=${user%%:*} gid=${user#*:}
[[ $uid =~ ^[0-9]+$ && $gid =~ ^[0-9]+$ ]] || { echo "run-in-image: --user must be numeric UID[:GID], not $user" >&2; exit 2; }

[[ -n $entrypoint ]] && img_ep=("$entrypoint")
declare -a argv=("${img_ep[@]}")
if (($#)); then argv+=("$@"); else argv+=("${img_cmd[@]}"); fi
((${#argv[@]})) || { echo "run-in-image: $image has no entrypoint or cmd, and none was given" >&2; exit 2; }

# --- container + overlay mount -------------------------------------------------------------------
podman rm -f "$name" >/dev/null 2>&1 || true  # a leftover of a killed run
cid=$(podman create --name "$name" "$image" "${argv[@]}")
timer=""
cleanup() {
  [[ -z $timer ]] || kill "$timer" 2>/dev/null || true
  if ((keep)); then echo "run-in-image: kept container $name ($cid)" >&2; return; fi
  podman umount "$cid" >/dev/null 2>&1 || true
  podman rm -f "$cid" >/dev/null 2>&1 || true
}
trap cleanup EXIT
root=$(podman mount "$cid")

# Mount points the namespace needs: created in the container's own writable layer (discarded by rm).
for d in proc sys dev tmp etc; do mkdir -p "$root/$d"; done
for f in hosts resolv.conf hostname; do [[ -e $root/etc/$f ]] || : >"$root/etc/$f"; done
for v in "${volumes[@]}"; do
  IFS=: read -r hpath cpath _ <<<"$v"
  [[ -e $hpath ]] || { echo "run-in-image: volume source $hpath does not exist" >&2; exit 2; }
  if [[ -d $hpath ]]; then mkdir -p "$root$cpath"; else mkdir -p "$(dirname "$root$cpath")"; [[ -e $root$cpath ]] || : >"$root$cpath"; fi
done

# Environment: the image's, then -e overrides (env -i below: nothing of the host's leaks in).
declare -A seen=(); declare -a final_env=()
for kv in "${envs[@]}" "${img_env[@]}"; do
  k=${kv%%=*}; [[ -n ${seen[$k]:-} ]] && continue; seen[$k]=1; final_env+=("$kv")
done
[[ -n ${seen[HOSTNAME]:-} ]] || final_env+=("HOSTNAME=$name")

# --- inside private mount + PID namespaces: mounts, then chroot as the user ----------------------
# Process tree: this script -> unshare (PDEATHSIG=KILL: dies with this script, even on SIGKILL)
#   -> bash, PID 1 of a new PID namespace (killed by unshare --kill-child; when it dies the kernel
#      kills everything in the namespace) -> the command (setpriv, chroot and env exec into it).
# So killing this script in any way leaves no process behind; the namespace's mounts go with it.
export RII_ROOT=$root RII_RO=$read_only RII_TMP=$tmp_size RII_UID=$uid RII_GID=$gid RII_WD=$workdir
export RII_VOLUMES; RII_VOLUMES=$(printf '%s\n' "${volumes[@]}")
set +e
setpriv --pdeathsig KILL unshare --mount --propagation private --pid --fork --kill-child -- \
    bash -euo pipefail -c '
  r=$RII_ROOT
  mount --bind "$r" "$r"                                   # so that the root can be remounted ro
  ((RII_RO)) && mount -o remount,bind,ro "$r"
  mount -t proc -o nosuid,nodev,noexec proc "$r/proc"      # this PID namespace only
  mount --rbind /sys "$r/sys"; mount -o remount,bind,ro "$r/sys" 2>/dev/null || true
  mount -t tmpfs -o nosuid,mode=755,size=64k tmpfs "$r/dev"   # a minimal /dev, as a runtime gives
  for n in null zero full random urandom tty; do : >"$r/dev/$n"; mount --bind "/dev/$n" "$r/dev/$n"; done
  mkdir "$r/dev/shm" "$r/dev/pts"
  mount -t tmpfs -o nosuid,nodev,mode=1777,size=64m shm "$r/dev/shm"
  mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$r/dev/pts" 2>/dev/null || true
  ln -s /proc/self/fd "$r/dev/fd"; ln -s /proc/self/fd/0 "$r/dev/stdin"
  ln -s /proc/self/fd/1 "$r/dev/stdout"; ln -s /proc/self/fd/2 "$r/dev/stderr"; ln -s pts/ptmx "$r/dev/ptmx"
  mount -t tmpfs -o nosuid,nodev,mode=1777,size="$RII_TMP" tmpfs "$r/tmp"   # the chart s emptyDir
  for f in hosts resolv.conf hostname; do [[ -e /etc/$f ]] && mount --bind "/etc/$f" "$r/etc/$f"; done
  while IFS= read -r v; do
    [[ -n $v ]] || continue
    IFS=: read -r h c mode <<<"$v"
    mount --bind "$h" "$r$c"
    [[ $mode == ro ]] && mount -o remount,bind,ro "$r$c"
  done <<<"$RII_VOLUMES"
  # no_new_privs = allowPrivilegeEscalation: false; a non-root uid has no capabilities left.
  # The command is not PID 1 (this shell is), so it gets default signal dispositions.
  setpriv --no-new-privs chroot --userspec="$RII_UID:$RII_GID" --groups="$RII_GID" "$r" \
       /usr/bin/env -i -C "$RII_WD" "$@" <&0 &
  cmd=$!
  trap "kill -TERM $cmd 2>/dev/null" TERM INT HUP
  while :; do wait $cmd && rc=0 || rc=$?; kill -0 $cmd 2>/dev/null || exit $rc; done
' run-in-image "${final_env[@]}" "${argv[@]}" <&0 &
child=$!
# Forward SIGTERM/SIGINT to the command (through the namespace's PID 1), then SIGKILL the whole
# namespace after the grace period, as a kubelet does. (A JAX process that called
# jax.distributed.initialize catches SIGTERM for preemption and can sit in a 3-minute barrier.)
terminate() {
  local init; init=$(cut -d' ' -f1 "/proc/$child/task/$child/children" 2>/dev/null || true)
  kill -TERM "${init:-$child}" 2>/dev/null || return 0
  [[ -n $timer ]] || { ( sleep "$grace"; kill -KILL "$child" 2>/dev/null ) & timer=$!; }
}
trap terminate TERM INT HUP
while :; do
  wait "$child"; rc=$?
  kill -0 "$child" 2>/dev/null || break   # wait returned for a trapped signal: keep waiting
done
exit $rc
