"""The quotas pages."""
