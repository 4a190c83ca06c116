"""One module per subcommand; each defines ``register(app)``. Modules starting with _ are helpers."""
