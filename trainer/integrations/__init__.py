"""Integrations of the trainer library with the training loops people already run, one module
per framework (hf, lightning) or loop shape (own: a job's own checkpointer), each built from
the trainer's parts; import the one you use explicitly (it imports its framework)."""
