"""polychip router: one OpenAI endpoint in front of many ``polychip serve`` replicas.

app (FastAPI routes) -> proxy (forward, retry, stream) -> dispatch (priority queues, placement)
-> policies (fastest by default, round_robin, least_load, prefix_aware); health checks and the supervisor keep the
replica set current; rollout owns canary weights and per-version figures.
"""
