"""The preemption pages."""
