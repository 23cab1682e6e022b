"""Questions in: the consumer loop, its read-ahead window and back-pressure, the trust boundary, one answer per question, and the offsets committed after each answer is acked."""
