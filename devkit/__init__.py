"""A local trainguard cluster on one machine (controller + sim agents + a real torchrun job) for
the demo, the end-to-end tests and the benchmarks; not used by the daemons themselves."""
