"""trainguard controller: rules, incidents, actions, store, REST API and agentctl."""

__version__ = "0.1.0"
