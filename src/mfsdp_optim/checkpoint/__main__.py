"""``python -m mfsdp_optim.checkpoint inspect DIR``."""

import sys

from ._inspect import main

if __name__ == "__main__":
    sys.exit(main())
