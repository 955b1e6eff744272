"""env_gateway: the async gateway between agent funcs and environment servers, its client,
and the built-in environment servers (``env_gateway.servers.<name>``).

Agent funcs talk only to the gateway (``/v1/sessions``...); the gateway speaks each backend's
own protocol (AgentGym's, or the gym-style chat protocol) to a pool of replicas.
"""
