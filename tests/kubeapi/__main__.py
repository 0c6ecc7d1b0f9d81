"""Run the fake API server: `python -m tests.kubeapi --port 0 --kubeconfig PATH [--crd FILE ...]`.

Prints its URL as the first line on stdout (and nothing else there), then serves until killed.
"""

import argparse
import asyncio
import os
import pathlib
import sys

import kmock
import yaml

from .server import BigBodyServer, KubeApi
from .store import Store


def kubeconfig(url: str) -> dict:
    # Plain http and a dummy token: every client accepts it, and no client sends a real credential.
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kubeapi", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {"token": "kubeapi-test-token"}}],
        "contexts": [{"name": "kubeapi", "context": {"cluster": "kubeapi", "user": "tester", "namespace": "default"}}],
        "current-context": "kubeapi",
        "preferences": {},
    }


async def serve(args: argparse.Namespace) -> None:
    api = KubeApi(store=Store(history=args.history))
    for path in args.crd:
        names = api.load_crds(pathlib.Path(path).read_text())
        print(f"kubeapi: loaded CRDs {names} from {path}", file=sys.stderr)
    async with api, kmock.Server(api, host=args.host, port=args.port or None, server_cls=BigBodyServer) as server:
        url = f"http://{server.host}:{server.port}"
        if args.kubeconfig:
            pathlib.Path(args.kubeconfig).write_text(yaml.safe_dump(kubeconfig(url)))
        print(url, flush=True)
        stop = asyncio.Event()
        if args.exit_with_stdin:
            # The harness holds our stdin: if the test process dies without killing us, EOF ends us.
            asyncio.get_running_loop().add_reader(sys.stdin.fileno(), lambda: os.read(sys.stdin.fileno(), 4096) or stop.set())
        await stop.wait()  # or until the process is terminated


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.kubeapi", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--kubeconfig", help="write a kubeconfig for this server here")
    parser.add_argument("--crd", action="append", default=[], help="a YAML file of CRDs to create at start-up")
    parser.add_argument("--history", type=int, default=10000,
                        help="watch events kept for resourceVersion replays; older ones get 410 Gone")
    parser.add_argument("--exit-with-stdin", action="store_true", help="exit when stdin reaches EOF")
    args = parser.parse_args()
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
