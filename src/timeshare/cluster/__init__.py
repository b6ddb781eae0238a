"""timeshare on a Ray cluster: one runtime per device in a Ray actor, a router in front
(NOTE [Cluster deployment] in ``cluster/cluster.py``). Ray is imported only when a
cluster starts."""
