"""trainguard node agent: hardware and trainer health collection, export and reporting."""

__version__ = "0.1.0"
