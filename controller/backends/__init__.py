"""Where jobs run: the scheduler backends behind one interface (base.SchedulerBackend) that
every remediation step asks: torchrun launched by the agents (the default) and Slurm."""
