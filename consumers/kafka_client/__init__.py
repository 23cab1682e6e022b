"""The one Kafka client layer: opening clients (security, acks, the bounded stop), the fetch guard and its readers, InitProducerId for Tansu, and topic creation."""
