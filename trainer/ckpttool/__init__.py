"""`trainguard-ckpt`: list, verify, show, prune, export and restore-drill a job's checkpoints
(local or S3).

cli.py parses and prints; sources.py reads a checkpoint directory or bucket through the
trainer's own reader and verifier; export.py consolidates a checkpoint's model weights from
its per-rank shards into one safetensors file; drill.py restores one (usually from the
second-region replica) into a directory a job resumes from, proving it whole and loadable.
"""
