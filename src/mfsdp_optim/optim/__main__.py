"""``python -m mfsdp_optim.optim classify package.module:Class``: an optimizer class's update
kind, with the evidence (``mfsdp_optim.optim.classify_update``); exit status 1 when the package
would step it faster than the evidence allows (see ``_cli``)."""

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
