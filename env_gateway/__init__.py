"""env_gateway: the async gateway between agent funcs and environment servers, its client,
and the built-in environment servers (``env_gateway.servers.<name>``).

Agent funcs talk only to the gateway (``/v1/sessions``...); the gateway speaks each backend's
own protocol (AgentGym's, or the gym-style chat protocol) to a pool of replicas.

    python -m env_gateway --port 8800 --env babyai=http://127.0.0.1:8001,http://127.0.0.1:8002
    python -m env_gateway --config gateway.yaml

Modules: ``server`` (the service: routing, admission control, deadlines, failure handling),
``adapters`` (one small class per backend protocol), ``client`` (``GatewayClient`` for agent funcs),
``config`` (flags and YAML), ``spawn`` (replicas the gateway starts and restarts), ``metrics``
(Prometheus), ``http1`` (the lean keep-alive HTTP client the gateway uses towards backends), ``fake_backend``
(a stand-in env server speaking every protocol variant the adapters know: load tests and plumbing checks).
"""
