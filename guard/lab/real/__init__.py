"""The lab's real backend: real kube-apiserver replicas on real etcd, each behind its own fault proxy
(and optionally kube-scheduler and kube-controller-manager), driven through the same interface as the
Python lab (``guard.lab.backend.LabBackend``). Test and demo infrastructure only; see docs/LAB.md.

Nothing is imported here: ``guard.lab.real.etcdwire`` is pure and light, ``guard.lab.real.etcdproxy``
needs ``grpcio`` (the ``lab`` extra), ``guard.lab.real.controlplane`` has ``RealLab``,
``guard.lab.real.binaries`` finds the binaries; import the module you need.
"""
