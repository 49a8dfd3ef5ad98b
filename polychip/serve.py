"""``python -m polychip.serve``: the same as ``polychip serve``."""
import sys

from polychip.commands.serve import main

if __name__ == "__main__":
    sys.exit(main())
