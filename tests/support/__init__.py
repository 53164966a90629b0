"""What the tests share: tiny checkpoints of every family, a local Hub server, the per-query CCA loop, where
Triton tests run."""
