"""trainguard controller: the central daemon and agentctl.

The map, by layer (lower layers never import higher ones; tests/unit/test_layers.py):
- base: config, errors, views (API read models), records (store record types), metrics,
  actionkinds (the ActionKind table), storeurl.
- store: store/ (one repository per table over one Database; schema and migrations; the
  lease and its fence), backup.
- state: livestate (what the latest reports say), signals/ (per-target signal history),
  jobs (job specs and the job table), jobstate (JobState and its transitions).
- rules: rules/ (language, loader, engine, cost, Prometheus export), model (Target, Decision),
  incidents (the incident state machine), safety (budget, breaker, silences), growplan.
- actions: actions/ (handlers, the worker, notify, drain, job steps), backends/ (where jobs
  run: one package per scheduler behind a registry with capabilities).
- services: reports (the ingest stage of a report), queries, operations, tick (rule ticks and
  the action worker loop), maintenance, storewatch, service (the ControllerService Protocol).
- top: api/ (routes per resource; a report's path: receive -> decode -> ingest), ingest/
  (worker processes), auth, tlsauth, connlimits, ha (leader/standby), composition (the
  composition root: Controller), main (the daemon), cli (agentctl).
"""
