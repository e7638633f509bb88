"""``python -m mfsdp_optim.checkpoint inspect DIR``: what a checkpoint holds, and whether it is
whole (``inspect_checkpoint``); the options and exit statuses: ``_cli`` and docs/cli.md."""

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
