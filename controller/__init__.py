"""trainguard controller: rules, incidents, actions, store, REST API and agentctl."""
