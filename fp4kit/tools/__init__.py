"""Commands over existing checkpoints: convert, repair, inspect, audit, eval."""
