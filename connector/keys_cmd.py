"""`triptych keys`: make CURVE keypairs for the tcp transport and the router's sockets."""
from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "keys", help="make CURVE keypairs for pool workers across hosts",
        description="Write one keypair per name: DIR/private/NAME.key_secret (0600, copy it "
                    "only to the host that runs NAME) and DIR/public/NAME.key (copy the "
                    "public folder to every host). A tcp endpoint admits exactly the keys "
                    "in its public folder; delete a file there to revoke a node.")
    p.add_argument("dir", help="key directory (created if missing)")
    p.add_argument("--names", required=True,
                   help="comma-separated node names, e.g. router,prefill-0,decode-0")


def run(args: argparse.Namespace) -> int:
    import sys

    from triptych.connector.auth import generate_keys
    from triptych.connector.envelope import ConnectorError

    names = [n.strip() for n in args.names.split(",") if n.strip()]
    try:
        for path in generate_keys(args.dir, names):
            print(path)
    except ConnectorError as e:
        print(f"triptych keys: {e}", file=sys.stderr)
        return 1
    return 0
