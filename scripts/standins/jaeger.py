#!/usr/bin/env python3
"""A stand-in for Jaeger's all-in-one image (jaegertracing/jaeger), for CI that cannot pull it.

scripts/standin-images builds it into an image under Jaeger's own name, from Debian's python3:
no registry, npm, PyPI or Debian package carries Jaeger. It keeps to what the demo uses of the
real one, with the same ports and shapes, so that compose.yaml and scripts/demo run unchanged
against either:

  4318   OTLP over HTTP: POST /v1/traces, protobuf or JSON (gzip too), as the services send
  16686  the query API the demo reads: GET /api/services, GET /api/traces/{traceId} and
         GET /api/traces?service=S&limit=N, in Jaeger's JSON (traceID, spans with their
         operationName, references, startTime and duration in microseconds, tags, processID;
         processes with their serviceName)
         and a page per trace, GET /trace/{traceId}, as the job page links it (a waterfall drawn
         from the API; Jaeger's own UI is far richer), and GET / listing the latest traces

Traces are kept in memory, the latest 10,000 (the real image's memory store keeps 100,000).
"""

import gzip
import json
import re
import signal
import struct
import sys
import threading
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

MAX_TRACES = 10_000
KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}

traces = OrderedDict()  # trace id (32 hex) -> {span id: (service, resource tags, span)}
lock = threading.Lock()


# --- OTLP protobuf, the few messages a trace export holds -------------------------------------


def fields(data):
    """(field number, wire type, value) of each field of a protobuf message."""
    at = 0

    def varint():
        nonlocal at
        shift = result = 0
        while True:
            byte = data[at]
            at += 1
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result
            shift += 7

    while at < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            yield number, wire, varint()
        elif wire == 1:
            yield number, wire, data[at : at + 8]
            at += 8
        elif wire == 2:
            length = varint()
            yield number, wire, data[at : at + length]
            at += length
        elif wire == 5:
            yield number, wire, data[at : at + 4]
            at += 4
        else:
            raise ValueError(f"wire type {wire}")


def any_value(data):
    for number, _, value in fields(data):
        if number == 1:
            return value.decode("utf-8", "replace")
        if number == 2:
            return bool(value)
        if number == 3:
            return value - (1 << 64) if value >= 1 << 63 else value
        if number == 4:
            return struct.unpack("<d", value)[0]
        if number == 7:
            return value.hex()
    return ""


def key_values(data_list):
    result = []
    for data in data_list:
        key, value = "", ""
        for number, _, field in fields(data):
            if number == 1:
                key = field.decode("utf-8", "replace")
            elif number == 2:
                value = any_value(field)
        result.append((key, value))
    return result


def protobuf_spans(body):
    """(resource attributes, span) of each span of an ExportTraceServiceRequest."""
    for number, _, resource_spans in fields(body):
        if number != 1:
            continue
        resource, scopes = [], []
        for number, _, field in fields(resource_spans):
            if number == 1:
                resource = key_values(value for n, _, value in fields(field) if n == 1)
            elif number == 2:
                scopes.append(field)
        for scope in scopes:
            for number, _, data in fields(scope):
                if number == 2:
                    yield resource, protobuf_span(data)


def protobuf_span(data):
    span = {"attributes": [], "kind": 0, "error": False, "parent": ""}
    attributes = []
    for number, _, value in fields(data):
        if number == 1:
            span["trace"] = value.hex()
        elif number == 2:
            span["id"] = value.hex()
        elif number == 4:
            span["parent"] = value.hex()
        elif number == 5:
            span["name"] = value.decode("utf-8", "replace")
        elif number == 6:
            span["kind"] = value
        elif number == 7:
            span["start"] = struct.unpack("<Q", value)[0]
        elif number == 8:
            span["end"] = struct.unpack("<Q", value)[0]
        elif number == 9:
            attributes.append(value)
        elif number == 15:
            span["error"] = any(n == 3 and v == 2 for n, _, v in fields(value))
    span["attributes"] = key_values(attributes)
    return span


# --- OTLP JSON --------------------------------------------------------------------------------


def json_value(value):
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in value:
            return value[key]
    if "intValue" in value:
        return int(value["intValue"])
    return json.dumps(value)


def json_spans(body):
    for resource_spans in body.get("resourceSpans", []):
        resource = [(a["key"], json_value(a.get("value", {}))) for a in resource_spans.get("resource", {}).get("attributes", [])]
        for scope in resource_spans.get("scopeSpans", []):
            for data in scope.get("spans", []):
                yield resource, {
                    "trace": data["traceId"].lower(),
                    "id": data["spanId"].lower(),
                    "parent": data.get("parentSpanId", "").lower(),
                    "name": data.get("name", ""),
                    "kind": int(data.get("kind", 0)),
                    "start": int(data.get("startTimeUnixNano", 0)),
                    "end": int(data.get("endTimeUnixNano", 0)),
                    "error": int(data.get("status", {}).get("code", 0)) == 2,
                    "attributes": [(a["key"], json_value(a.get("value", {}))) for a in data.get("attributes", [])],
                }


def keep(received):
    with lock:
        for resource, span in received:
            service = dict(resource).get("service.name", "unknown_service")
            trace = traces.setdefault(span["trace"], {})
            trace[span["id"]] = (service, resource, span)
            traces.move_to_end(span["trace"])
        while len(traces) > MAX_TRACES:
            traces.popitem(last=False)


# --- Jaeger's JSON ----------------------------------------------------------------------------


def jaeger_id(hex_id):
    """A trace id as Jaeger writes it: the high half without leading zeros, if not zero."""
    high, low = int(hex_id[:-16] or "0", 16), int(hex_id[-16:], 16)
    return f"{high:x}{low:016x}" if high else f"{low:016x}"


def tag(key, value):
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64", "value": value}
    if isinstance(value, float):
        return {"key": key, "type": "float64", "value": value}
    return {"key": key, "type": "string", "value": str(value)}


def jaeger_trace(trace_id, spans):
    processes, process_ids, out = {}, {}, []
    for service, resource, span in spans.values():
        process = (service, tuple((k, str(v)) for k, v in resource))
        if process not in process_ids:
            process_ids[process] = f"p{len(process_ids) + 1}"
            processes[process_ids[process]] = {
                "serviceName": service,
                "tags": [tag(k, v) for k, v in resource if k != "service.name"],
            }
        tags = [tag(k, v) for k, v in span["attributes"]]
        if span["kind"] in KINDS:
            tags.append(tag("span.kind", KINDS[span["kind"]]))
        if span["error"]:
            tags += [tag("otel.status_code", "ERROR"), tag("error", True)]
        references = []
        if span["parent"] and span["parent"] != "0" * 16:
            references.append({"refType": "CHILD_OF", "traceID": jaeger_id(trace_id), "spanID": span["parent"]})
        out.append(
            {
                "traceID": jaeger_id(trace_id),
                "spanID": span["id"],
                "operationName": span["name"],
                "references": references,
                "startTime": span["start"] // 1000,
                "duration": max(0, span["end"] - span["start"]) // 1000,
                "tags": tags,
                "logs": [],
                "processID": process_ids[process],
                "warnings": None,
            }
        )
    out.sort(key=lambda span: span["startTime"])
    return {"traceID": jaeger_id(trace_id), "spans": out, "processes": processes, "warnings": None}


def normalized(trace_id):
    trace_id = trace_id.lower()
    if not re.fullmatch(r"[0-9a-f]{1,32}", trace_id):
        return None
    return trace_id.rjust(32, "0")


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>Trace</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222 }
.note { color: #666 } table { border-collapse: collapse; width: 100% }
td { padding: 2px 6px; vertical-align: top; border-bottom: 1px solid #eee; white-space: nowrap }
td.bar { width: 50%; position: relative } .bar div { position: absolute; top: 4px; height: 12px; background: #4a8fd8 }
.error div { background: #d84a4a } .tags { color: #666; white-space: normal; font-size: 12px }
</style></head><body>
<h1 id="title">Trace</h1>
<p class="note">A stand-in for Jaeger's UI (CI's, from scripts/standin-images): the spans of one
trace, in the order they began. The real image, jaegertracing/jaeger, shows the same trace.</p>
<table id="spans"></table>
<script>
const id = location.pathname.split("/").pop();
document.getElementById("title").textContent = "Trace " + id;
fetch("/api/traces/" + id).then(r => r.json()).then(({ data, errors }) => {
  const table = document.getElementById("spans");
  if (!data || !data.length) { table.textContent = (errors && errors[0].msg) || "trace not found"; return; }
  const trace = data[0];
  const parents = Object.fromEntries(trace.spans.map(s => [s.spanID, (s.references[0] || {}).spanID]));
  const depth = s => { let d = 0, p = parents[s.spanID]; while (p && parents[p] !== undefined && d < 20) { d++; p = parents[p]; } return d; };
  const start = Math.min(...trace.spans.map(s => s.startTime));
  const end = Math.max(...trace.spans.map(s => s.startTime + s.duration));
  const width = Math.max(1, end - start);
  for (const span of trace.spans) {
    const row = table.insertRow();
    row.dataset.service = trace.processes[span.processID].serviceName;
    row.dataset.operation = span.operationName;
    const error = span.tags.some(t => t.key === "error" && t.value === true);
    row.insertCell().textContent = "\\u00a0\\u00a0".repeat(depth(span)) + row.dataset.service;
    row.insertCell().textContent = span.operationName;
    row.insertCell().textContent = (span.duration / 1000).toFixed(1) + " ms";
    const bar = row.insertCell(); bar.className = "bar" + (error ? " error" : "");
    const box = document.createElement("div");
    box.style.left = (100 * (span.startTime - start) / width) + "%";
    box.style.width = Math.max(0.3, 100 * span.duration / width) + "%";
    bar.append(box);
    const tags = table.insertRow().insertCell(); tags.colSpan = 4; tags.className = "tags";
    tags.textContent = span.tags.map(t => t.key + "=" + t.value).join("  ");
  }
});
</script></body></html>
"""

HOME = """<!doctype html>
<html><head><meta charset="utf-8"><title>Traces</title></head>
<body style="font: 14px system-ui, sans-serif; margin: 1.5em">
<h1>Traces</h1><p>A stand-in for Jaeger's UI: the latest traces.</p><ul id="traces"></ul>
<script>
fetch("/api/traces?limit=50").then(r => r.json()).then(({ data }) => {
  for (const trace of data) {
    const root = trace.spans[0] || {};
    const item = document.createElement("li"), link = document.createElement("a");
    link.href = "/trace/" + trace.traceID;
    link.textContent = trace.traceID + " " + (root.operationName || "") + " (" + trace.spans.length + " spans)";
    item.append(link); document.getElementById("traces").append(item);
  }
});
</script></body></html>
"""


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def send(self, status, body, content_type="application/json"):
        if not isinstance(body, bytes):
            body = json.dumps(body).encode() if content_type == "application/json" else body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        # Read whatever is sent, so that the connection can carry the next request.
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if urlparse(self.path).path != "/v1/traces":
            return self.send(404, {"error": "not found"})
        if self.headers.get("Content-Encoding", "") == "gzip":
            body = gzip.decompress(body)
        try:
            if self.headers.get("Content-Type", "").startswith("application/json"):
                received = list(json_spans(json.loads(body)))
                answer, content_type = json.dumps({}).encode(), "application/json"
            else:
                received = list(protobuf_spans(body))
                answer, content_type = b"", "application/x-protobuf"
        except (ValueError, KeyError, IndexError, struct.error) as error:
            return self.send(400, {"error": f"not an OTLP trace export: {error}"})
        keep(received)
        self.send(200, answer, content_type)

    def do_GET(self):
        url = urlparse(self.path)
        if url.path == "/api/services":
            with lock:
                names = sorted({service for trace in traces.values() for service, _, _ in trace.values()})
            return self.send(200, {"data": names, "total": len(names), "limit": 0, "offset": 0, "errors": None})
        if url.path == "/api/traces":
            query = parse_qs(url.query)
            service = query.get("service", [None])[0]
            limit = query.get("limit", ["20"])[0]
            if not limit.isdigit():
                return self.send(400, {"data": None, "errors": [{"code": 400, "msg": "limit: not a number"}]})
            limit = int(limit)
            with lock:
                found = [
                    jaeger_trace(trace_id, dict(spans))
                    for trace_id, spans in reversed(traces.items())
                    if service is None or any(s == service for s, _, _ in spans.values())
                ][:limit]
            return self.send(200, {"data": found, "total": len(found), "limit": 0, "offset": 0, "errors": None})
        match = re.fullmatch(r"/api/traces/([^/]+)", url.path)
        if match:
            trace_id = normalized(match.group(1))
            with lock:
                spans = dict(traces.get(trace_id, {})) if trace_id else {}
            if not spans:
                error = {"code": 404, "msg": "trace not found"}
                return self.send(404, {"data": None, "total": 0, "limit": 0, "offset": 0, "errors": [error]})
            data = [jaeger_trace(trace_id, spans)]
            return self.send(200, {"data": data, "total": 0, "limit": 0, "offset": 0, "errors": None})
        if re.fullmatch(r"/trace/[0-9a-fA-F]{1,32}", url.path):
            return self.send(200, PAGE, "text/html; charset=utf-8")
        if url.path in ("/", "/search"):
            return self.send(200, HOME, "text/html; charset=utf-8")
        self.send(404, {"error": "not found"})


def main():
    # As a container's first process, SIGTERM (docker stop) does nothing unless handled.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    servers = [ThreadingHTTPServer(("0.0.0.0", port), Handler) for port in (4318, 16686)]
    for server in servers[1:]:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print("jaeger stand-in: OTLP/HTTP on :4318, query API and pages on :16686", file=sys.stderr, flush=True)
    servers[0].serve_forever()


if __name__ == "__main__":
    main()
