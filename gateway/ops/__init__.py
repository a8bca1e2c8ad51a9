"""What the gateway tells its operator: the access log and the Prometheus metrics."""
