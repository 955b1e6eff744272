"""OpenRLHF agent_func modules, one per environment: ``--train.agent_func_path agent_funcs/<env>.py``."""
