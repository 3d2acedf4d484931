"""Subcommands of the ``tandem`` command line, one module each."""
