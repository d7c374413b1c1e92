"""Watching a node: Prometheus metrics, per-hop timings and JSON logs."""
