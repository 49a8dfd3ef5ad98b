"""polychip trust init|add-key|revoke: write a site trust store (docs/packages.md).

  polychip trust init DIR --key site.pub [--not-after 2027-06-30] [--serving-user polychip]
  polychip trust add-key DIR --key next.pub [--not-after DATE]
  polychip trust revoke DIR (--key-id ID | --key lost.pub) --reason TEXT
"""
from __future__ import annotations

import argparse
import datetime

from polychip.commands.common import fail
from polychip.errors import PolychipError
from polychip.flags import Parser


def _date(text: str) -> datetime.date:
    try:
        return datetime.date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a date YYYY-MM-DD, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="polychip trust", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)     # subparsers are Parsers too (flags.py)
    init = sub.add_parser("init", help="a new trust store trusting one key")
    add = sub.add_parser("add-key", help="trust one more key")
    for s in (init, add):
        s.add_argument("dir", help="the trust store's folder")
        s.add_argument("--key", required=True, help="an Ed25519 public key (polychip keygen's .pub)")
        s.add_argument("--not-after", type=_date, default=None,
                       help="the last day the key verifies (default: a year from today)")
    init.add_argument("--serving-user", default=None,
                      help="give releases.json, the one file the serving user writes, to this user")
    rev = sub.add_parser("revoke", help="refuse a key from now on, by id or key file")
    rev.add_argument("dir")
    which = rev.add_mutually_exclusive_group(required=True)
    which.add_argument("--key-id", help="the key id (64 hex digits; polychip keygen printed it)")
    which.add_argument("--key", help="the public key file")
    rev.add_argument("--reason", required=True)
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from polychip.trust import admin
    try:
        if args.action == "init":
            store = admin.init(args.dir, args.key, args.not_after, args.serving_user)
        elif args.action == "add-key":
            store = admin.add_key(args.dir, args.key, args.not_after)
        else:
            store = admin.revoke(args.dir, args.key_id or args.key, args.reason)
    except PolychipError as e:
        return fail(e)
    for k in store.keys:
        state = f"revoked ({store.revoked[k.key.key_id]})" if k.key.key_id in store.revoked else \
            f"valid until {k.not_after}"
        print(f"key {k.key.key_id[:16]}  {k.key.path}  {state}")
    print(f"trust store {store.path}: {len(store.keys)} key(s), {len(store.revoked)} revoked; "
          f"serve with --trust-store {store.folder}")
    return 0
