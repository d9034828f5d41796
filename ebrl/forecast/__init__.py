"""What a run is predicted to cost: the runtime in virtual time (virtual.py) and the GPU cost model (gpu_cost.py)."""
