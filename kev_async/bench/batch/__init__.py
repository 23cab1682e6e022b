"""`kev bench batch`: interactive latency through the gateway alone and beside a running Batch API batch,
on one embedded broker and one worker.

command.py   the flags (`register`, what `kev --help` imports)
run.py       the measurement and the report
"""

from kev_async.bench.batch.command import register

__all__ = ["register"]
