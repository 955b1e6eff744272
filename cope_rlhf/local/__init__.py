"""The single-machine front-end (``python -m cope_rlhf.local {train,sft}``): the same driver as the cluster
(``cope_rlhf.cli.train_ppo_ray``, OpenRLHF's real Ray PPO path; on a host without CUDA its CPU mode), with the env
side started for you and defaults for a small run.

    trainer.py      ``train``: the flags, the env stack, the run, its summary
    env_stack.py    the gateway and the env server(s) it supervises
    sft.py          ``sft``: the supervised warm start on expert demos
"""
