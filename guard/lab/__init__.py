"""The ghost lab: real etcd, apiserver replicas with their own watch caches and faults.

Test and demo infrastructure only: nothing on the guard's serving path imports it.
See docs/LAB.md.
"""

from guard.lab.etcd import Etcd, EtcdError
from guard.lab.faults import DropRule, DroppedEvent, FaultError, FaultRule, Faults
from guard.lab.lab import Lab
from guard.lab.replica import ApiserverReplica, RequestRecord

__all__ = ["ApiserverReplica", "DropRule", "DroppedEvent", "Etcd", "EtcdError", "FaultError", "FaultRule", "Faults", "Lab",
           "RequestRecord"]
