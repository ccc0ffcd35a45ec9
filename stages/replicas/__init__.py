"""The Dask lifecycle of target replicas shared by extract, generate and online: the cluster, one replica, the online worker."""
