"""Kev's runtime: actors on anyio, app wiring, config loading, logging and the `kev` CLI."""
