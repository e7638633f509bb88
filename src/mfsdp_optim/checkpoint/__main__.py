"""``python -m mfsdp_optim.checkpoint inspect DIR`` (see ``_cli`` and docs/cli.md)."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
