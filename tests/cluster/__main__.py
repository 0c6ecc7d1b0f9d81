"""`python -m tests.cluster up` starts the local cluster and prints its kubeconfig's path;
`python -m tests.cluster down` stops it (tests/cluster/launcher.py)."""

import argparse
import sys

from tests.cluster import launcher


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster", description=__doc__)
    parser.add_argument("command", choices=("up", "down"))
    args = parser.parse_args()
    if args.command == "down":
        launcher.down()
        return 0
    try:
        running = launcher.up()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(running.kubeconfig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
