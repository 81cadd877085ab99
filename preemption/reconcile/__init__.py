"""Level-triggered reconcilers: compare what the database wants with what the
runtime observes right now, and move ranks and jobs forward.

Each pass over an attempt has two steps, and no runtime call (a process
launch, a signal, a Kubernetes request, a log read) is made while a
transaction is open or a row is locked:

- *decide*, in one short transaction: record what the runtime observed, move
  the job's state on, and record the runtime action the attempt needs next on
  the attempt row (launch attempt N, signal its ranks, kill them at the
  deadline, forget the finished gang);
- *act*, after that commits: claim the action with a conditional update, make
  the runtime call, and record its outcome in another short transaction.

A runtime call can take seconds. On the embedded SQLite a transaction holds
the database's only write lock from its start, so a call made inside one
would keep every other writer waiting, job submissions included.

Every step is idempotent and claims its row with a conditional update, so a
second reconcile of the same state, or two workers at once, change nothing
more: an action is carried out by the one worker that claimed it (a claim
left by a worker that died expires after ACTION_LEASE), signals are sent once
per preemption (a repeat is harmless), an attempt is finished once, and a job
is requeued once.

A temporary runtime error leaves the action in place with its count, its
message and the time of the next try (exponential backoff, shown on the job
page); a launch gives up after QM_RUNTIME_TRIES. A permanent error fails that
attempt with its reason. Neither stops the pass for the other attempts.

The stages, one module each, in the order of a job's path; each imports only
those before it:

- `steps`: what the stages hand one another (`Step`, the gang spec, `guarded`);
- `hold`: this machine's launch hold and exits listener's beat (marker files);
- `observe`: the open attempts as rows, and recording what the runtime observed;
- `logs`: reading the ranks' logs for the trap's events;
- `decide`: the decide transaction, and `request_stop`;
- `act`: claiming, carrying out and recording the runtime actions;
- `finish`: closing the attempts whose ranks all exited;
- `passes`: one pass (`reconcile_jobs`, `launch_admitted`), which runs the stages;
- `exits` and `shutdown`, apart: the exits listener, and stopping the ranks with
  the portal; both use the pass's entry points.
"""

from preemption.reconcile.decide import request_stop
from preemption.reconcile.exits import listen_for_exits
from preemption.reconcile.hold import hold_launches
from preemption.reconcile.passes import launch_admitted, reconcile_jobs
from preemption.reconcile.shutdown import RankShutdown, live_rank_count

__all__ = [
    "RankShutdown",
    "hold_launches",
    "launch_admitted",
    "listen_for_exits",
    "live_rank_count",
    "reconcile_jobs",
    "request_stop",
]
