"""The lab's real backend: real kube-apiserver replicas (and optionally kube-scheduler and
kube-controller-manager) on the lab's etcd, driven through the same interface as the Python lab.

Test and demo infrastructure only. See docs/LAB.md ("The real backend").
"""
