"""The API reference page at /v1/docs: one self-contained HTML page that renders
/v1/openapi.json as a list of operations with their parameters, bodies and answers. Nothing
is loaded from anywhere but the controller itself (its Content-Security-Policy says so), so
the page works on an air-gapped cluster."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

__all__ = ["DOCS_CSP", "DOCS_PAGE", "add_docs_page"]

# inline script and style only; data from this origin only; no fonts, images or frames
DOCS_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

DOCS_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>trainguard controller API</title>
<style>
body { font-family: sans-serif; margin: 2em auto; max-width: 60em; line-height: 1.4; }
h2 { border-bottom: 1px solid #ccc; margin-top: 2em; }
.op { border: 1px solid #ddd; border-radius: 4px; margin: 0.6em 0; padding: 0.4em 0.8em; }
.method { font-weight: bold; display: inline-block; min-width: 4em; }
code, pre { background: #f5f5f5; padding: 0 0.2em; }
pre { padding: 0.5em; overflow-x: auto; font-size: 0.85em; }
details > summary { cursor: pointer; }
</style>
</head>
<body>
<h1>trainguard controller API</h1>
<p>From <a href="openapi.json">openapi.json</a>. Authenticated routes take
<code>Authorization: Bearer TOKEN</code>; errors are JSON <code>{error, detail}</code>.</p>
<div id="api">Loading openapi.json ...</div>
<script>
"use strict";
function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}
function schemaOf(content) {
  if (!content) return null;
  const first = Object.values(content)[0];
  return first && first.schema ? first.schema : null;
}
function resolve(doc, schema) {
  if (schema && schema["$ref"]) {
    const name = schema["$ref"].split("/").pop();
    return {name: name, body: (doc.components.schemas || {})[name] || {}};
  }
  return {name: null, body: schema};
}
function schemaBlock(doc, label, schema) {
  const d = el("details");
  const r = resolve(doc, schema);
  d.appendChild(el("summary", label + (r.name ? " (" + r.name + ")" : "")));
  d.appendChild(el("pre", JSON.stringify(r.body, null, 2)));
  return d;
}
function render(doc) {
  const root = document.getElementById("api");
  root.textContent = "";
  root.appendChild(el("p", doc.info.title + ", version " + doc.info.version));
  const byTag = {};
  for (const [path, item] of Object.entries(doc.paths)) {
    for (const [method, op] of Object.entries(item)) {
      const tag = (op.tags && op.tags[0]) || "other";
      (byTag[tag] = byTag[tag] || []).push([method, path, op]);
    }
  }
  for (const [tag, ops] of Object.entries(byTag)) {
    root.appendChild(el("h2", tag));
    for (const [method, path, op] of ops) {
      const box = el("div", undefined, "op");
      const head = el("div");
      head.appendChild(el("span", method.toUpperCase(), "method"));
      head.appendChild(el("code", path));
      box.appendChild(head);
      if (op.summary) box.appendChild(el("p", op.summary));
      if (op.description) box.appendChild(el("p", op.description));
      for (const p of op.parameters || []) {
        box.appendChild(el("div", p.in + " " + p.name + (p.required ? " (required)" : "") +
          (p.description ? ": " + p.description : "")));
      }
      const body = op.requestBody && schemaOf(op.requestBody.content);
      if (body) box.appendChild(schemaBlock(doc, "request body", body));
      for (const [code, resp] of Object.entries(op.responses || {})) {
        const s = schemaOf(resp.content);
        const label = code + " " + (resp.description || "");
        box.appendChild(s ? schemaBlock(doc, label, s) : el("div", label));
      }
      root.appendChild(box);
    }
  }
}
fetch("openapi.json").then(function (r) {
  if (!r.ok) throw new Error("openapi.json: HTTP " + r.status);
  return r.json();
}).then(render).catch(function (e) {
  document.getElementById("api").textContent = String(e);
});
</script>
</body>
</html>
"""


def add_docs_page(app: FastAPI, *, path: str = "/v1/docs") -> None:
    """Serve DOCS_PAGE at `path` (no auth, as the OpenAPI document it reads)."""

    async def docs() -> HTMLResponse:
        return HTMLResponse(DOCS_PAGE, headers={"Content-Security-Policy": DOCS_CSP})

    app.add_api_route(path, docs, methods=["GET"], include_in_schema=False)
