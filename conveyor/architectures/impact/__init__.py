"""IMPACT (Luo et al. 2020): worker processes with their own policy (``workers.py``), the shared-memory weight broadcast (``params.py``), circular buffer and target network (``run.py``)."""
