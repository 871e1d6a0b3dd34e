"""trainguard node agent: hardware and trainer health collection, export and reporting.

The map: daemon (the composition root and its loop) over sources (each collector on its own
schedule and deadline) and collectors/ (nvml, infiniband, xid: plain data out); heartbeat (the
trainer ranks' datagrams) with senders (which process may speak for which job); metrics (the
/metrics exposition, built from the contract's signal table); reporter (reports, the event
spool, commands back); commands (the command handlers), jobs/jobwrap/launchrec/jobpolicy (the
torchrun backend's launches, outliving the agent), stacks, preemption, sim (simulated hardware).
"""
