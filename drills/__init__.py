"""The preemption drill: the mission's verification protocol, end to end.

A package above the domain apps: it drives quotas, preemption and telemetry
through their services and reads their models, and none of them imports it
(an import-linter contract keeps it so). `harness` runs the drill with real
processes, on `base` (its settings and state), `setup` (the cluster it runs on)
and `measure` (the figures of a round, the chaos checks); `result` types what it measured and judges it against the targets
in `telemetry.mission`, and `integrity` compares a resumed run with an
uninterrupted one bit for bit.
"""
