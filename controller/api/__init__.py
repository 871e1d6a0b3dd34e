"""The controller's REST API (`/v1`): the app (app.py), one module of routes per resource
(reports, nodes, incidents, jobs, silences, audit, rules, meta), the request checks
(requests.py), the one error shape (errors.py) and route registration with its OpenAPI
document (routing.py).

The API calls only `ControllerService`. Every body is decoded by the wire decoders of
`trainguard.wire_schemas` (strict, field paths in errors) and every answer is encoded with
`trainguard.protocol.to_wire` (non-finite floats as strings), so no NaN ever reaches JSON. The
OpenAPI document at `/v1/openapi.json` is generated from the same wire schemas.
Errors are always `{"error": "...", "detail": ...}`; bad input gets a 4xx, never a 5xx.

Identity: a report is accepted only for the node its credential speaks for (an agent token's
`node:`, or the node a client certificate names; see `tlsauth`), checked once per report
after decoding, in-process and for reports handed over by ingest workers alike: a mismatch is
a 403 naming both, audited, and nothing is stored. A repeated Authorization header is a 400 on
every route (two credentials in one request would be read differently by different layers).
"""
