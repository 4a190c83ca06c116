"""Recipe-driven pipelines: recipes, their steps, the demo.

``from fp4kit.pipeline import run_recipe``."""

__all__ = ["run_recipe"]


def __getattr__(name: str) -> object:
    # resolved on first use: importing a submodule of this package must not import the whole command
    if name in __all__:
        from fp4kit.pipeline import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
