"""Watching a running Kev: Prometheus metrics and their endpoint (metrics), the `kev top` view
(dashboard), the per-forward isolation audit checker (audit) and its picture (mask_picture)."""
