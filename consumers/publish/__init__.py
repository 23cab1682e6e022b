"""Answers out: the publisher and its sender, records cut to size, failures and their fallbacks, n samples gathered, reply topics, and exactly-once transactions."""
