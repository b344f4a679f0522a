"""`python -m mqks.server` runs mqksd."""

from .cli import main

main()
