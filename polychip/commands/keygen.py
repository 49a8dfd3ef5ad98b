"""polychip keygen -o NAME: a new Ed25519 signing key (NAME, mode 0600) and its public key (NAME.pub)."""
from __future__ import annotations


from polychip.commands.common import fail
from polychip.errors import PolychipError
from polychip.flags import Parser


def main(argv: list[str]) -> int:
    p = Parser(prog="polychip keygen", description=__doc__)
    p.add_argument("-o", "--output", required=True, help="private key file; the public key goes to OUTPUT.pub")
    args = p.parse_args(argv)
    from polychip.trust import keys as signing
    try:
        private, public = signing.keygen(args.output)
        kid = signing.key_id(signing.load_trusted_key(public).key)
    except PolychipError as e:
        return fail(e)
    print(f"private key {private} (mode 0600: keep it secret; pack --sign-key {private})")
    print(f"public key  {public} (give it to the sites that load your packages: --trusted-key {public})")
    print(f"key id      {kid}")
    return 0
