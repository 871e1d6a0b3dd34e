"""Where jobs run: the scheduler backends behind one interface (base.SchedulerBackend), each a
package (torchrun/, the default, launched by the agents; slurm/) registered with its declared
capabilities in registry.py; build.py builds the configured one."""
