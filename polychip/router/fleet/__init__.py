"""The fleet: the replicas behind the router and the devices under them. One ``Worker`` per
replica (worker.py: health, breaker, load), the registry of them, the device ledger (the one owner
of "device -> holder"), the launcher of child processes, and the one lifecycle of the replicas this
router launches (deployment replicas and workloads alike)."""
