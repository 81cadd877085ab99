"""The telemetry pages."""
