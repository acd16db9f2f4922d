"""Trainers: draft heads (eagle, eagle3, mtp), losses, the training loop, export."""
