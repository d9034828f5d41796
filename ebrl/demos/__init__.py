"""Demonstrations: a scripted expert's episodes recorded in robomimic's HDF5 layout or LeRobot's (`python -m ebrl.demos
record`), and the readers `algo=sft` trains from, for those and a user's own files or LeRobot datasets
(docs/use/demos.md, docs/internals/design.md "Demonstrations, SFT, RL")."""
