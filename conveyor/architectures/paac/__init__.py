"""PAAC (Clemente et al. 2017): synchronous batched A2C/PPO; ``run.py`` wires the vector env, rollout storage and learner."""
