"""Grafana dashboards, built in Python from the server's metric names (serving.metric_names)."""
