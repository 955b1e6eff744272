"""The single-machine path (``python -m cope_rlhf.local {train,sft}``): OpenRLHF's own rollout, experience and PPO
code on one machine (CPU, or one GPU), with the same agent funcs, gateway, env servers and CoPE signals as the
cluster path.

    rollout.py      OpenRLHF's RolloutRayActor (Ray + vLLM) and SamplesGenerator; the prompt stream
    weight_sync.py  new weights into the vLLM engine (a worker extension, safetensors bytes, reload_weights)
    models.py       policy / reference in this process, behind OpenRLHF's actor-group calling surface
    strategy.py     the DeepSpeed-strategy calls OpenRLHF's trainer makes, for one process and a torch optimizer
    env_stack.py    the gateway and the env server(s) it supervises
    checkpoint.py   save / resume (weights, optimizer, schedule, step, prompt position, RNG)
    trainer.py      the training loop and its CLI (``train``)
    sft.py          the supervised warm start on expert demos (``sft``)
"""
