"""The minimal pass-through extender the guard is measured against.

What a platform team would write in five minutes with Flask: decode the
request, pass every node, encode. Served by gunicorn with the same worker
model as the guard (``gthread``), so the comparison isolates the guard's own
work. Run: ``gunicorn -k gthread --threads 16 -b 127.0.0.1:PORT benchmarks.passthrough_extender:app``.
"""

from flask import Flask, jsonify, request

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
