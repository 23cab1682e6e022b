"""`kev bench gateway` (also `python -m kev_async.bench.gateway`): what the HTTP gateway adds to a question's
latency over publishing it to Kafka directly, at a given concurrency, on one embedded broker and one worker.

command.py        the flags (`register`, what `kev --help` imports)
run.py            the measurement: rounds alternating between the two paths, and the report
http_client.py    the HTTP path's client: lean keep-alive connections
kafka_client.py   the direct path's client: aiokafka, answers on a reply topic of its own
processes.py      `kev gateway` / `kev serve` as child processes, and the CPU they use
"""

from kev_async.bench.gateway.command import register

__all__ = ["register"]
