"""The lab's real backend: real kube-apiserver replicas on real etcd, each behind its own fault proxy.

Nothing is imported here: ``guard.lab.real.etcdwire`` is pure and light, ``guard.lab.real.etcdproxy``
needs ``grpcio`` (the ``lab`` extra); import the module you need.
"""
