"""Planning without Python's cyclic garbage collector running in the middle.

A plan allocates hundreds of thousands of small objects (the pending jobs, the queue
keys of the order, the candidate victims), and reference counting frees almost all
of them. The cyclic collector still starts a young collection every 700 allocations
and, every so often, a full one that walks every live object of the process: the
snapshot's workloads and, in a worker, everything Django and Celery loaded. On the
engine benchmark's cluster those collections took 0.1-0.5 s of a 0.65 s plan, and
more the longer the process had lived.

Paused for the plan, the collector catches up at its first young collection after
it, which walks what the plan built and still holds. The plan leaves almost nothing in
reference cycles for it to free: the candidates' link back from the ledger is undone
when the passes end, and the fair-share division and the statuses' lending walk the
tree with lists of work rather than recursive inner functions (each of which would
hold itself and, through its closure, the tree and its memo of common ancestors:
about 48,000 objects on the engine benchmark's cluster).

The reconcile pass (preemption.reconcile.passes) pauses it the same way, for the same
reason: the rows and observations of a first pass over a large cluster.

The standard library has the switch (`gc.disable`) but no scoped form of it that
leaves a collector someone else paused as it found it, hence this helper.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Run the block with the cyclic collector off; it is back on afterwards only if it
    was on before (a caller's pause, or a program that runs without it, is kept)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
