"""The minimal pass-through extender the guard is measured against.

What a platform team would write in five minutes with Flask: decode the
request, pass every node, encode. Served by gunicorn with the same worker
model as the guard (``gthread``), so the comparison isolates the guard's own
work. Run: ``gunicorn -k gthread --threads 16 -b 127.0.0.1:PORT benchmarks.passthrough_extender:app``.

``orjson_app`` is the same with orjson instead of Flask's JSON (decode the body, encode the reply):
the faster pass-through the hot path is held to (``benchmarks/filter_hotpath.py``).
"""

import orjson
from flask import Flask, Response, jsonify, request

app = Flask(__name__)


@app.post("/filter")
def filter_nodes():
    args = request.get_json()
    return jsonify({"Nodes": args.get("Nodes"), "NodeNames": args.get("NodeNames"), "FailedNodes": {},
                    "FailedAndUnresolvableNodes": {}, "Error": ""})


@app.post("/preempt")
def preempt():
    args = request.get_json()
    return jsonify({"NodeNameToMetaVictims": args.get("NodeNameToMetaVictims") or {}})


@app.get("/healthz")
def healthz():
    return jsonify({"status": "ok"})


orjson_app = Flask("passthrough_orjson")


@orjson_app.post("/filter")
def filter_nodes_orjson():
    args = orjson.loads(request.get_data())
    return Response(orjson.dumps({"Nodes": args.get("Nodes"), "NodeNames": args.get("NodeNames"), "FailedNodes": {},
                                  "FailedAndUnresolvableNodes": {}, "Error": ""}), mimetype="application/json")


@orjson_app.get("/healthz")
def healthz_orjson():
    return Response(b'{"status":"ok"}', mimetype="application/json")
