"""Demonstrations: a scripted expert's episodes recorded in robomimic's HDF5 layout (`python -m ebrl.demos record`),
and the reader `algo=sft` trains from, for those and a user's own files (docs/design.md, "Demonstrations, SFT, RL")."""
