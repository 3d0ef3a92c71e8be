"""``python -m guard`` is ``ghost-guard``."""

from guard.cli import main

main()
