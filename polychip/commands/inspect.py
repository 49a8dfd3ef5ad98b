"""polychip inspect PKG [--json]: devices, quantisation, minimum memory, plan summary, version
matrix and files of a package (from its hash-checked manifest and plan; weights not read)."""
from __future__ import annotations

import json

from polychip.commands.common import fail
from polychip.errors import PolychipError
from polychip.flags import Parser


def main(argv: list[str]) -> int:
    p = Parser(prog="polychip inspect", description=__doc__)
    p.add_argument("package")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    args = p.parse_args(argv)
    from polychip.package.describe import describe, describe_text
    try:
        d = describe(args.package)
    except PolychipError as e:
        return fail(e)
    print(json.dumps(d, indent=2) if args.json else describe_text(d))
    return 0
