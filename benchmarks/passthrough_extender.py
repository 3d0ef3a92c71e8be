"""The minimal pass-through extender the guard is measured against.

What a platform team would write in five minutes with Flask: decode the
request, pass every node, encode. Served by gunicorn with the same worker
model as the guard (``gthread``), so the comparison isolates the guard's own
work. Run: ``gunicorn -k gthread --threads 16 -b 127.0.0.1:PORT benchmarks.passthrough_extender:app``.

``orjson_app`` is the same with orjson instead of Flask's JSON (decode the body, encode the reply):
the faster pass-through the hot path is held to (``benchmarks/filter_hotpath.py``).

``floor_app`` is ``app`` plus the least that the guard's guarantee costs the control plane: one quorum GET
of each pending pod, made ahead of the scheduler's call as the guard makes it (a watch of unscheduled pods,
``spec.nodeName=``, on one replica; each ADDED pod read once from etcd by a pool of 16 threads over
kept-alive connections, the guard's own GET transport ``guard.kube.transport.Connections``), with no
verdict, cache, listing, view or metric. Its ``/filter`` is ``app``'s. It is measured beside the guard
(``benchmarks/cpu_per_pod_real.py --floor``) to split the guard's gap to the pass-through into what any
extender keeping "a quorum GET per pod" pays and what is the guard's own. Configured by the environment:
``FLOOR_APISERVER`` (``https://host:port``), ``FLOOR_CA`` (CA file), ``FLOOR_TOKEN`` (bearer token).
"""

import http.client
import os
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote, urlsplit

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


floor_app = Flask("passthrough_floor")
floor_app.add_url_rule("/filter", view_func=filter_nodes, methods=["POST"])
floor_app.add_url_rule("/preempt", view_func=preempt, methods=["POST"])
floor_app.add_url_rule("/healthz", view_func=healthz, methods=["GET"])
floor_stats = {"events": 0, "gets": 0, "get_errors": 0}
_floor_lock = threading.Lock()


def _floor_count(key: str) -> None:
    with _floor_lock:  # 16 threads count: ``+=`` on a dict item is not atomic
        floor_stats[key] += 1


@floor_app.get("/floor")
def floor_counts():
    with _floor_lock:
        return jsonify(floor_stats)


def _floor_follow(url: str, ca: str, token: str) -> None:
    """Watch unscheduled pods from now; GET every pod added, once, from etcd (no resourceVersion)."""
    from guard.kube.transport import Connections, GetError

    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
    conns = Connections(url, {"ca_certs": ca}, keep=16)
    pool = ThreadPoolExecutor(16, thread_name_prefix="floor-get")

    def get(namespace: str, name: str) -> None:
        try:
            reply = conns.get(f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}",
                              headers, 5.0)
            _floor_count("gets" if reply.status in (200, 404) else "get_errors")
        except GetError:
            _floor_count("get_errors")

    parts = urlsplit(url)
    while True:
        try:
            http_conn = http.client.HTTPSConnection(parts.hostname, parts.port,
                                                    context=ssl.create_default_context(cafile=ca), timeout=330)
            http_conn.request("GET", "/api/v1/pods?watch=1&fieldSelector=spec.nodeName%3D&timeoutSeconds=300",
                              headers=headers)
            resp = http_conn.getresponse()
            while line := resp.readline():
                event = orjson.loads(line)
                _floor_count("events")
                meta = (event.get("object") or {}).get("metadata") or {}
                if event.get("type") == "ADDED" and meta.get("name"):
                    pool.submit(get, meta.get("namespace", ""), meta["name"])
            http_conn.close()
        except (OSError, http.client.HTTPException, ValueError):
            threading.Event().wait(0.5)


if os.environ.get("FLOOR_APISERVER"):
    threading.Thread(target=_floor_follow, name="floor-watch", daemon=True,
                     args=(os.environ["FLOOR_APISERVER"], os.environ["FLOOR_CA"], os.environ["FLOOR_TOKEN"])).start()
