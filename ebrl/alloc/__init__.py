"""Resource allocation: measured stage profiles, and the planner that splits a node's cores and GPU between stages."""
