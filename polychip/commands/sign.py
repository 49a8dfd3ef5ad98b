"""polychip sign FILE --key KEY: a detached Ed25519 signature FILE.sig beside any YAML the platform
reads (device specs, deployment files); serve --device-config and the router check it against
the site's trust store (--trust-store)."""
from __future__ import annotations


from polychip.commands.common import fail
from polychip.errors import PolychipError
from polychip.flags import Parser


def main(argv: list[str]) -> int:
    p = Parser(prog="polychip sign", description=__doc__)
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--key", required=True, help="Ed25519 private key (polychip keygen)")
    args = p.parse_args(argv)
    from polychip.trust import keys as signing
    from polychip.trust.detached import sign_file
    try:
        kid = signing.key_id(signing.load_private_key(args.key).public_key())
        for path in args.files:
            print(f"signed {path} -> {sign_file(path, args.key)} (key {kid[:16]})")
    except PolychipError as e:
        return fail(e)
    return 0
