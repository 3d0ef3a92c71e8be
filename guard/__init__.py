"""kube-ghost-guard: stop kube-scheduler from looping on ghost Pods.

Where is a ghost decided? In :mod:`guard.core.verdict` (``decide``).
"""

__version__ = "0.1.0"
