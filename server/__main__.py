"""`python -m mqks.server` runs mqksd."""

from .app import main

main()
