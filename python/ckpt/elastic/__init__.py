"""Elastic PyTorch training: survivors of a lost rank keep training, in the same
processes, on a smaller world resharded from the newest checkpoint.

A script started by ``ckpt launch`` with an elastic flag (``--min-ranks``,
``--max-restarts``, ``--nnodes``, ``--rdzv``) calls :func:`run` once::

    def train(ctx):
        model, opt = build(ctx.device)
        step = ctx.resume(args.ckpt, state(model, opt))      # newest commit, resharded
        ckpt = ctx.checkpointer(args.ckpt)
        while step < args.steps:
            ...one step...
            step += 1
            if ctx.step(step) or step % every == 0:
                ckpt.save(step, state(model, opt)).wait_committed()
                if ctx.stopping:
                    return

    ckpt.elastic.run(train, backend="gloo")

Each turn of :func:`run` is a *generation* of the job, formed by ckpt's control
plane (the library's agent, through the binding: the same agent and protocol as the
reference trainer's): rendezvous, a process group for that generation's rank and
world (a store of its own, so that a rank of another generation cannot join it),
``train(ctx)``, and whatever ended it:

- a lost or hung member: the agent's thread aborts the process group (on gloo it
  shuts the group's sockets down, which fails a collective blocked on a dead or a
  stopped peer at once; on NCCL it aborts the communicators), the training thread
  gets :class:`WorldChanged`, the group is torn down, and ``train`` is called again
  in the next generation, where ``ctx.resume`` loads the newest commit resharded;
- a regroup (ranks wait to join) or a stop (SIGTERM or SIGINT to any rank): the
  ranks agree on a step through ``ctx.step``, save it, and the generation ends at
  that commit; stopped ranks exit with 75, the others go on;
- ``train`` returned: the job trained to its end; every rank exits 0.

Saves go through ``ctx.checkpointer``, fenced by the generation: its run id and
checkpoint generation are the generation's, so a rank of an older generation (a
process resumed after SIGSTOP) can commit nothing over a newer one.

Resumes take the newest *healthy* commit (no non-finite tensor or metric, replicas
that agreed), saying which unhealthy ones they passed over. A bad step (a
non-finite loss, a spike) rolls the job back to it in the same processes::

        loss = ...forward...
        if ctx.rollback_if(*ctx.bad_loss(loss)) is not None:
            step, cursor = ctx.restored.step, ctx.restored.mine["data.cursor"]
            continue

and a job that keeps going back to the same commit stops with :class:`RollbackLoop`
(``run(..., max_rollbacks=3)``).

``import ckpt.elastic`` does not import torch (an optional extra): torch is imported
when :func:`run` or a :class:`Context` method needs it. The package's modules, one
idea each: ``_context`` (what ``train`` gets), ``_run`` (the generations loop),
``_group`` (one generation's process group), ``_watch`` (the watcher that ends a
wedged member), ``_sockets`` (the connections an abort shuts down), ``_ending``
(how a member reads its generation's end, and its exit codes), ``_checkpointer``
(saves fenced by the generation), ``_rollback`` (rollbacks in a row, the loss
check), ``_torch_workarounds`` (torch's private state).
"""

from ckpt.elastic._context import Context, WorldChanged
from ckpt.elastic._ending import EXIT_STOPPED, EXIT_WEDGED
from ckpt.elastic._rollback import RollbackLoop
from ckpt.elastic._run import run

# The watcher's delays, public before the package was split; read from here, set
# (as the tests do) on ``ckpt.elastic._watch``, whose values the watcher reads.
from ckpt.elastic._watch import LEAVING_AFTER_ABORT as LEAVING_AFTER_ABORT
from ckpt.elastic._watch import STUCK_AFTER_ABORT as STUCK_AFTER_ABORT
from ckpt.elastic._watch import WEDGED_AFTER_ABORT as WEDGED_AFTER_ABORT

__all__ = ["EXIT_STOPPED", "EXIT_WEDGED", "Context", "RollbackLoop", "WorldChanged", "run"]
