"""EBRL: asynchronous embodied RL with fine-grained CPU/GPU resource management.

Importing the package imports nothing heavy: simulator workers import `ebrl.envs` under
interpreters that have numpy and a simulator but no torch.
"""
