"""Chapter 7: production. Health that cannot lie, graceful drain, deadlines, metrics, JSON logs, hot reload, leak hunting."""
