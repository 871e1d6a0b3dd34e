"""trainguard node agent: hardware and trainer health collection, export and reporting."""
