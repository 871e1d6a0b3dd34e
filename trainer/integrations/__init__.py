"""Integrations of the trainer library with the training loops people already run."""
