"""Pipeline parallelism: one model split by layers over devices of different vendors and speeds
(docs/pipeline-parallel.md)."""
