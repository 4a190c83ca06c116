"""Expert parallelism: splitting a checkpoint's experts by rank, placement, per-rank scales."""
