"""Train stage: the training loop and its pieces (setup, step, evaluation, save, resume), the training-time-test unroll, losses, export."""
