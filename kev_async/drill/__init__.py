"""`kev drill`: a fault drill on the embedded broker with real `kev serve` processes, then the checks
that nothing was lost.

run.py       the drill's course: workers started, questions published over time, the faults, the stop
workers.py   the `kev serve` processes, one consumer group, each logging JSON to its own file
topics.py    the drill's own Kafka clients: questions published, answers read, the group's commits
broker.py    the broker's SIGKILL and restart on its data mid-stream
checks.py    what the run must show afterwards: one final answer each, commit after ack, no KV leak
"""
