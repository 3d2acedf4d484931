"""Entry point for ``python -m tandem``."""

from tandem.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
