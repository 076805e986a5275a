"""The race's runners for peers in virtual environments of their own (``conveyor.bench.external``).

Each file here but this one is a standalone script, run by path by a peer's own Python with ``-I``: conveyor is
not installed there, so they import only the standard library, the peer's packages and ``race_watch`` (their
shared part, which each puts on ``sys.path`` from this folder, where nothing else could shadow a module).
"""
