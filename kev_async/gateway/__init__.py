"""Kev's OpenAI-compatible HTTP gateway: OpenAI requests become QuestionEvents on Kafka, and the
answers (and streaming deltas) on this instance's reply topic become OpenAI responses."""
