"""`python -m distzo <command>`: the command line (distzo.cli)."""

from .cli import main

if __name__ == "__main__":
    main()
