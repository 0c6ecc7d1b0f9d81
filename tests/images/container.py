"""Built images, and their containers started the way a kubelet starts a pod's container.

`podman run` is refused here (crun cannot setrlimit), so a container is `run-in-image.sh`: podman
create + mount, then chroot as the image's user in private mount and PID namespaces, with the image's
environment and entrypoint, a fresh /proc, /dev, /dev/shm and /tmp, and the host's network (a pod
with hostNetwork). Every container is stopped, and its podman container removed, when its `with`
block ends, failing or not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

RUNNER = Path(__file__).resolve().with_name("run-in-image.sh")


def podman(*args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result


@dataclasses.dataclass(frozen=True)
class Image:
    """A built image's tag and the runtime configuration it declares."""

    tag: str
    config: dict[str, Any]  # the image's Config: User, Env, Entrypoint, ExposedPorts, ...
    size: int

    @classmethod
    def inspect(cls, tag: str) -> Image:
        (found,) = json.loads(podman("image", "inspect", tag).stdout)
        return cls(tag, found["Config"], found["Size"])

    @property
    def user(self) -> str:
        return self.config.get("User") or ""

    @property
    def entrypoint(self) -> list[str]:
        return self.config.get("Entrypoint") or []

    @property
    def env(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.config.get("Env") or [])

    @property
    def exposed_ports(self) -> set[int]:
        return {int(port.split("/")[0]) for port in self.config.get("ExposedPorts") or {}}


def _runner_command(
    image: Image,
    args: Sequence[str],
    *,
    name: str | None,
    user: str | None,
    entrypoint: str | None,
    env: Mapping[str, str],
    volumes: Sequence[str],
    read_only: bool,
    grace: float,
) -> list[str]:
    command = [str(RUNNER), "--grace", str(grace)]
    if name:
        command += ["--name", name]
    if user:
        command += ["--user", user]
    if entrypoint:
        command += ["--entrypoint", entrypoint]
    if read_only:
        command.append("--read-only")
    for key, value in env.items():
        command += ["-e", f"{key}={value}"]
    for volume in volumes:
        command += ["-v", volume]
    return [*command, image.tag, *args]


def exec_in_image(
    image: Image, *args: str, entrypoint: str | None = None, read_only: bool = False, timeout: float = 120.0
) -> subprocess.CompletedProcess:
    """Run a short command in a fresh container of `image`, as its user; the container is removed."""
    command = _runner_command(
        image, args, name=None, user=None, entrypoint=entrypoint, env={}, volumes=(), read_only=read_only, grace=5
    )
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@dataclasses.dataclass
class Container:
    name: str
    process: subprocess.Popen
    stdout_path: Path
    stderr_path: Path

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(
            f"--- {self.name} {path.suffix[1:]}:\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            for path in (self.stdout_path, self.stderr_path)
        )

    def main_process(self, marker: str) -> int | None:
        """The host PID of the process in this container whose command line contains `marker`."""
        for pid in _descendants(self.process.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmdline and "run-in-image" not in cmdline:
                return pid
        return None

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (forwarded to the command; SIGKILL after the grace period), wait, then make sure the
        podman container is gone. Returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()  # its namespace dies with it (PDEATHSIG); the container is removed below
                self.process.wait(timeout=30)
        if podman("container", "exists", self.name, check=False).returncode == 0:
            podman("rm", "--force", self.name, check=False)
        return self.process.returncode


@contextlib.contextmanager
def running(
    image: Image,
    *args: str,
    name: str,
    log_dir: Path,
    user: str | None = None,
    entrypoint: str | None = None,
    env: Mapping[str, str] | None = None,
    volumes: Sequence[str] = (),
    read_only: bool = False,
    grace: float = 5.0,
) -> Iterator[Container]:
    """A container of `image` for the duration of the block, its output in log_dir/NAME.out and .err.
    A fixed `name` means a container left by a killed test run is removed by the next one."""
    command = _runner_command(
        image,
        args,
        name=name,
        user=user,
        entrypoint=entrypoint,
        env=env or {},
        volumes=volumes,
        read_only=read_only,
        grace=grace,
    )
    stdout_path, stderr_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
    with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr)
    container = Container(name, process, stdout_path, stderr_path)
    try:
        yield container
    finally:
        container.stop()


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the name, in (), may hold spaces
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def process_status(pid: int) -> dict[str, str]:
    """/proc/PID/status as a dict (Uid, Gid, CapEff, NoNewPrivs, ...)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, value in (line.split(":", 1) for line in lines if ":" in line)}


def root_mount_options(pid: int) -> set[str]:
    """The mount options of the file system the process sees as /."""
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == "/":
            return set(fields[5].split(","))
    raise AssertionError(f"no / in /proc/{pid}/mountinfo")


def own_dir(path: Path, uid: int) -> Path:
    """A directory owned by `uid`, as a volume the container's user writes to."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, uid, uid)
    return path
