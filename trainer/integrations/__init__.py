"""Integrations of the trainer library with training frameworks, one module per framework,
each built from the trainer's parts; import the one you use explicitly (it imports its
framework)."""
