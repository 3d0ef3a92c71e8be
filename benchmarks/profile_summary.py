"""Where the guard's CPU goes: groups py-spy raw samples (``python -m benchmarks.cpu_per_pod --profile DIR``).

Two views, in milliseconds of GIL-held time per pod (samples / rate / pods):

- **by activity**: what the thread was doing, from the stack (the quorum GET, the watch streams,
  the /filter request, the serving loop, ...);
- **by layer**: the innermost frame's module (the client layer's validation, its request building,
  urllib3, http.client, TLS and sockets, Flask/WSGI, metrics, cache, ...).

Run: ``python -m benchmarks.profile_summary DIR/live-100-0.txt [...] --pods 500 --rate 1000``.
"""

from __future__ import annotations

import argparse
import collections
import sys

# (activity, frames that mark it), first match wins, scanning the whole stack
ACTIVITIES = [
    ("quorum GET (Kube.quorum_get)", ("Kube.quorum_get ",)),
    ("watch streams: read, split, decode (ReplicaClient.watch_pending)", ("ReplicaClient.watch_pending ",)),
    ("watch events: apply to the views (Preparer.apply_event)", ("Preparer.apply_event ",)),
    ("watch re-list (pending_pods)", ("ReplicaClient.pending_pods ", "Preparer._watch_loop ")),
    ("/filter: decode, check, encode (FastLane, answer)", ("FastLane.__call__ ", "answer (guard/http/filter.py")),
    ("Flask app (other routes: /metrics, /readyz)", ("Flask.wsgi_app ",)),
    ("background verification, apart from the GET (verify_next, Checker.verify)",
     ("Preparer.verify_next ", "Checker.verify ")),
    ("sweep, discovery, connection sampling", ("Preparer._sweep_loop ",)),
    ("serving loop (GuardWorker, gunicorn)", ("guard/serving/worker.py", "gunicorn/")),
]

# (layer, path fragments of the innermost frame), first match wins
LAYERS = [
    ("client layer: argument validation (pydantic validate_call)", ("pydantic/",)),
    ("client layer: token refresh hook, proxy environment lookup",
     ("kubernetes/config/", "urllib/request.py", "<frozen os>", "Configuration.host", "Configuration.__setattr__")),
    ("client layer: request building, response wrapping (kubernetes.client)", ("kubernetes/",)),
    ("urllib3 (pool, request, response, chunked reads)", ("urllib3/",)),
    ("http.client and header parsing (email)", ("http/client.py", "email/")),
    ("TLS and socket I/O (ssl, socket, selectors)", ("ssl.py", "socket.py", "selectors.py")),
    ("Flask / werkzeug", ("flask/", "werkzeug/")),
    ("metrics (prometheus_client)", ("prometheus_client/",)),
    ("verdict cache (guard/engine/checker.py VerdictCache, cachetools)", ("cachetools/",)),
    ("watch decoding and views (guard/kube/watch.py, guard/engine/prepare.py, attribution)",
     ("guard/engine/prepare.py", "guard/core/attribution.py", "ReplicaClient.watch_pending")),
    ("quorum GET decoding (guard/kube/reads.py)", ("guard/kube/reads.py",)),
    ("serving loop (guard/serving/worker.py, gunicorn)", ("guard/serving/worker.py", "gunicorn/")),
    ("request path (guard/http, extender, check, verdict)", ("guard/",)),
    ("threads and queues (threading, concurrent.futures, queue)", ("threading.py", "concurrent/", "queue.py")),
    ("JSON logging, other stdlib", ("",)),
]


def classify(frames: list[str], table: list[tuple[str, tuple[str, ...]]], *, leaf: bool) -> str:
    for name, marks in table:
        if leaf:
            if frames and any(m in frames[-1] for m in marks):
                return name
        elif any(m in f for f in frames for m in marks):
            return name
    return "other"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--pods", type=int, default=500, help="pods per profiled run")
    ap.add_argument("--rate", type=float, default=1000.0, help="py-spy's sampling rate (Hz)")
    ap.add_argument("--top", type=int, default=15, help="innermost functions to list")
    args = ap.parse_args()
    activity: collections.Counter[str] = collections.Counter()
    layer: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    inside_get: collections.Counter[str] = collections.Counter()
    total = 0
    for path in args.files:
        with open(path) as f:
            for line in f:
                stack, _, count = line.rstrip("\n").rpartition(" ")
                if not count.isdigit():
                    continue
                n = int(count)
                frames = [fr for fr in stack.split(";") if not fr.startswith("process ")]
                total += n
                act = classify(frames, ACTIVITIES, leaf=False)
                activity[act] += n
                lay = classify(frames, LAYERS, leaf=True)
                layer[lay] += n
                if act.startswith("quorum GET"):
                    inside_get[lay] += n
                leaves[frames[-1] if frames else "?"] += n
    per_pod = 1000.0 / args.rate / (args.pods * len(args.files))
    print(f"{total} samples over {len(args.files)} run(s) of {args.pods} pods at {args.rate:g} Hz "
          f"= {total * per_pod:.2f} ms of GIL-held time per pod\n")
    for title, counter in (("by activity", activity), ("by layer (innermost frame)", layer),
                           ("inside the quorum GET, by layer", inside_get)):
        print(f"| {title} | ms/pod | share |\n|---|---:|---:|")
        for name, n in counter.most_common():
            print(f"| {name} | {n * per_pod:.3f} | {n / max(total, 1):.0%} |")
        print()
    print("| top innermost functions | ms/pod |\n|---|---:|")
    for name, n in leaves.most_common(args.top):
        print(f"| `{name}` | {n * per_pod:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
