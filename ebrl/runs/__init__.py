"""The kinds of run: training (experiment), evaluation, SFT and a sweep trial, over one base (base.py)."""
