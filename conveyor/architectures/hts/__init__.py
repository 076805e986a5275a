"""HTS-RL (Liu et al. 2020): executors and the state buffer (``state_buffer.py``), actor threads (``actors.py``), double storage and the one-step delayed gradient (``run.py``)."""
